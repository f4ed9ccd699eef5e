"""``p2psync ui`` against a real trainer node: the printed address opens the page, with the node's protections."""

from __future__ import annotations

import http.client
import subprocess
import urllib.request
from urllib.parse import urlsplit

import pytest
import tlsutil
from nodeproc import CLI, TOKEN, Cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

PROTECTIONS = ("Content-Security-Policy", "X-Content-Type-Options", "Referrer-Policy")


def get(url: str, cookie: str | None = None) -> http.client.HTTPResponse:
    """One GET as a browser sends it to the loopback tunnel (no redirect followed)."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    conn.request("GET", u.path + (f"?{u.query}" if u.query else ""), headers={"Cookie": cookie} if cookie else {})
    resp = conn.getresponse()
    resp.read()
    conn.close()
    return resp


def test_the_printed_address_opens_the_page_with_the_nodes_security_headers(tmp_path, cluster: Cluster):
    tr = cluster.start("trainer", "trainer")
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    tunnel = subprocess.Popen(CLI + ["ui", "--node", tr.url, "--tls-dir", str(tlsutil.authority().client()),
                                     "--token-file", str(token)], stdout=subprocess.PIPE, text=True)
    try:
        printed = tunnel.stdout.readline().strip()
        assert printed.startswith("http://127.0.0.1:") and printed.endswith(f"/ui?token={TOKEN}"), printed
        page_url = printed.split("?")[0]
        assert get(page_url).status == 401  # without the token or its cookie
        # The printed address: the token goes into a cookie and the browser is sent on to /ui.
        first = get(printed)
        assert first.status == 303 and first.headers["Location"] == "/ui"
        cookie = first.headers["Set-Cookie"].split(";")[0]
        page = get(page_url, cookie)
        assert page.status == 200 and page.headers["Content-Type"].startswith("text/html")
        direct = urllib.request.urlopen(urllib.request.Request(tr.url + "/ui", headers={
            "Authorization": f"Bearer {TOKEN}"}), context=tlsutil.client_context(), timeout=10)
        expected = {h: direct.headers[h] for h in PROTECTIONS}
        assert all(expected.values()), expected
        for resp in (first, page, get(page_url + "/state", cookie), get(page_url + "/assets/app.js", cookie)):
            assert {h: resp.headers[h] for h in PROTECTIONS} == expected
    finally:
        tunnel.terminate()
        tunnel.wait(30)
