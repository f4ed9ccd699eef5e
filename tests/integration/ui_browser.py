"""A headless Chromium driven over the DevTools protocol (aiohttp's websocket client), for the /ui test.

Launch with ``async with Browser.launch(tmp_dir) as b``; the browser process is started by this helper
and ended by its pid (``Browser.close`` over the protocol first, SIGKILL if it lingers).
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import signal
import subprocess
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parents[2]


def find_chromium() -> str | None:
    """The system chromium; runs tools/ensure_chromium.sh once when it is missing (installs it as root)."""
    for name in ("chromium", "chromium-browser"):
        if shutil.which(name):
            return shutil.which(name)
    subprocess.run(["bash", str(REPO / "tools" / "ensure_chromium.sh")], capture_output=True, timeout=900)
    return shutil.which("chromium")


class CDPError(RuntimeError):
    pass


class Page:
    """One tab (a flattened target session)."""

    def __init__(self, browser: Browser, session: str) -> None:
        self.browser = browser
        self.session = session

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        return await self.browser.send(method, params, self.session)

    async def evaluate(self, expression: str) -> Any:
        r = await self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise CDPError(f"{expression[:80]}: {r['exceptionDetails']}")
        return r["result"].get("value")

    async def goto(self, url: str, timeout: float = 30.0) -> None:
        r = await self.send("Page.navigate", url=url)
        if r.get("errorText"):
            raise CDPError(f"navigate {url}: {r['errorText']}")
        await self.wait_for("document.readyState === 'complete'", timeout, "page load")

    async def wait_for(self, expression: str, timeout: float, what: str, interval: float = 0.1) -> Any:
        """Poll a JS expression until it is truthy; returns its value."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            try:
                last = await self.evaluate(expression)
            except CDPError as exc:
                last = exc
            if last and not isinstance(last, Exception):
                return last
            await asyncio.sleep(interval)
        try:
            body = await self.evaluate("location.href + '\\n' + (document.body ? document.body.innerText : '')")
        except CDPError as exc:
            body = repr(exc)
        raise AssertionError(f"page never showed {what}: last={last!r}\npage: {str(body)[:2000]}\n"
                             f"console: {self.browser.console[-10:]}")

    async def screenshot(self, path: Path) -> Path:
        r = await self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(r["data"]))
        return path


class Browser:
    def __init__(self, proc: subprocess.Popen, ws: aiohttp.ClientWebSocketResponse,
                 http: aiohttp.ClientSession) -> None:
        self.proc = proc
        self.ws = ws
        self.http = http
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future] = {}
        self.console: list[str] = []
        self._reader = asyncio.create_task(self._read(), name="cdp-reader")

    @classmethod
    @asynccontextmanager
    async def launch(cls, profile: Path, executable: str, width: int = 1280, height: int = 900):
        profile.mkdir(parents=True, exist_ok=True)
        log = open(profile / "chromium.log", "wb")
        proc = subprocess.Popen(
            [executable, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--disable-sync",
             "--remote-debugging-port=0", f"--user-data-dir={profile}", f"--window-size={width},{height}",
             "about:blank"],
            stdout=log, stderr=log)
        log.close()
        http = aiohttp.ClientSession()
        browser = None
        try:
            port_file = profile / "DevToolsActivePort"
            deadline = time.monotonic() + 60
            while not (port_file.exists() and len(port_file.read_text().splitlines()) >= 2):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise CDPError("chromium did not open its DevTools port:\n"
                                   + (profile / "chromium.log").read_text(errors="replace")[-2000:])
                await asyncio.sleep(0.1)
            port, path = port_file.read_text().splitlines()[:2]
            ws = await http.ws_connect(f"ws://127.0.0.1:{port}{path}", max_msg_size=0)
            browser = cls(proc, ws, http)
            yield browser
        finally:
            if browser is not None:
                await browser.close()
            await http.close()
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)

    async def _read(self) -> None:
        async for msg in self.ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                break
            data = json.loads(msg.data)
            fut = self._waiting.pop(data.get("id"), None) if "id" in data else None
            if fut is not None and not fut.done():
                fut.set_result(data)
            elif data.get("method") == "Runtime.consoleAPICalled":
                args = data["params"].get("args", [])
                self.console.append(" ".join(str(a.get("value", a.get("description", ""))) for a in args))
            elif data.get("method") == "Runtime.exceptionThrown":
                self.console.append("exception: " + json.dumps(data["params"]["exceptionDetails"])[:500])
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(CDPError("DevTools connection closed"))

    async def send(self, method: str, params: dict[str, Any] | None = None, session: str | None = None,
                   timeout: float = 30.0) -> dict[str, Any]:
        mid = next(self._ids)
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._waiting[mid] = fut
        msg: dict[str, Any] = {"id": mid, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        await self.ws.send_str(json.dumps(msg))
        async with asyncio.timeout(timeout):
            reply = await fut
        if "error" in reply:
            raise CDPError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    async def new_page(self, width: int = 1280, height: int = 900) -> Page:
        target = (await self.send("Target.createTarget", {"url": "about:blank"}))["targetId"]
        session = (await self.send("Target.attachToTarget", {"targetId": target, "flatten": True}))["sessionId"]
        page = Page(self, session)
        await page.send("Page.enable")
        await page.send("Runtime.enable")
        await page.send("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1,
                        mobile=False)
        return page

    async def close(self) -> None:
        try:
            await self.send("Browser.close", timeout=5)
        except (CDPError, TimeoutError, ConnectionError):
            pass  # it is killed by pid below if it did not go
        for _ in range(50):
            if self.proc.poll() is not None:
                break
            await asyncio.sleep(0.1)
        self._reader.cancel()
        try:
            await self._reader
        except (asyncio.CancelledError, Exception):  # noqa: BLE001 - shutting down
            pass
        await self.ws.close()
