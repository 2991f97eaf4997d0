"""A headless Chromium driven over the DevTools protocol (aiohttp's websocket client): load a
page, run JavaScript in it, wait for the page to reach a state. For tests of pages whose
scripts run after load (a search index in a web worker), which --dump-dom cannot wait for."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any


# What DevTools answers an evaluation that a navigation overtook (a click's new page loading).
NAVIGATED = ("Inspected target navigated or closed", "Execution context was destroyed",
             "Cannot find context with specified id")


class NavigatedAway(Exception):
    """The page navigated while a call was in flight: the call means nothing, ask again."""


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which(
        "google-chrome")


class Browser:
    """`async with Browser(profile) as page:` one tab; page.goto(url), page.js(expr),
    page.wait_for(expr) (until truthy)."""

    def __init__(self, profile: Path, width: int = 1280, height: int = 1000):
        self.profile, self.size = profile, f"{width},{height}"

    async def __aenter__(self) -> "Browser":
        import aiohttp

        # --no-sandbox: tests run as root; the resolver rule keeps every host but loopback
        # unreachable, so a page renders as it would offline.
        self.proc = subprocess.Popen(
            [chromium(), "--headless", "--disable-gpu", "--no-sandbox", "--no-first-run",
             "--disable-dev-shm-usage", f"--user-data-dir={self.profile}",
             "--remote-debugging-port=0", f"--window-size={self.size}",
             "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1", "about:blank"],
            stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        for line in self.proc.stderr:
            found = re.search(r"DevTools listening on ws://[^:]+:(\d+)/", line)
            if found or time.monotonic() > deadline:
                break
        assert found, "chromium did not start its DevTools endpoint"
        listing = urllib.request.urlopen(f"http://127.0.0.1:{found.group(1)}/json/list")
        page = next(t for t in json.loads(listing.read()) if t["type"] == "page")
        self.session = aiohttp.ClientSession()
        self.ws = await self.session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)
        self.ids = 0
        await self.call("Page.enable")
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.ws.close()
        await self.session.close()
        self.proc.terminate()
        self.proc.wait(timeout=30)

    async def call(self, method: str, **params: Any) -> dict:
        self.ids += 1
        await self.ws.send_json({"id": self.ids, "method": method, "params": params})
        while True:
            message = await self.ws.receive_json()
            if message.get("id") == self.ids:
                error = message.get("error", {}).get("message", "")
                if any(n in error for n in NAVIGATED):
                    raise NavigatedAway(error)
                assert "error" not in message, message["error"]
                return message.get("result", {})

    async def js(self, expression: str) -> Any:
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True,
                                 awaitPromise=True)
        details = json.dumps(result.get("exceptionDetails", ""))
        if any(n in details for n in NAVIGATED):
            raise NavigatedAway(details)
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")

    async def goto(self, url: str) -> None:
        await self.call("Page.navigate", url=url)
        await self.wait_for("document.readyState === 'complete' && location.href !== "
                            "'about:blank'")

    async def wait_for(self, expression: str, timeout: float = 30) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = await self.js(expression)
            except NavigatedAway:  # a page on its way: ask the next one
                value = None
            if value:
                return value
            assert time.monotonic() < deadline, f"timed out waiting for: {expression}"
            await asyncio.sleep(0.1)
