"""A headless Debian `chromium` driven over the Chrome DevTools Protocol (tests only).

`Browser` starts ``chromium --headless`` with a fresh profile under the test's tmp_path and
``--remote-debugging-port=0``, reads the port chromium chose from ``DevToolsActivePort``,
and talks CDP (JSON messages over one WebSocket, with the `websockets` package the project
already uses) to the first page: navigate, evaluate JavaScript, set the viewport, take a
screenshot. No driver download, no network beyond 127.0.0.1.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from websockets.sync.client import ClientConnection, connect

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--remote-debugging-port=0", "--remote-allow-origins=*"]


def chromium_path() -> str | None:
    """The chromium binary, or None (then browser tests skip with that reason)."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    """One headless chromium with one page; a context manager."""

    def __init__(self, profile: Path, timeout: float = 60.0) -> None:
        exe = chromium_path()
        if exe is None:
            raise RuntimeError("chromium is not installed")
        profile.mkdir(parents=True, exist_ok=True)
        # chromium's own temp files (its singleton socket's folder, which it leaves behind
        # when terminated) go into a folder of ours, removed by `close`; a short path: a
        # Unix socket's path must fit in 108 bytes, which tmp_path's may not
        self.tmp = Path(tempfile.mkdtemp(prefix="hn-chromium-"))
        self.proc = subprocess.Popen([exe, *FLAGS, f"--user-data-dir={profile}",
                                      "about:blank"], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True,
                                     env=dict(os.environ, TMPDIR=str(self.tmp)))
        try:
            port = self._port(profile / "DevToolsActivePort", timeout)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list",
                                        timeout=10) as r:
                pages = [t for t in json.loads(r.read()) if t.get("type") == "page"]
            self.ws: ClientConnection = connect(pages[0]["webSocketDebuggerUrl"],
                                                max_size=64 * 1024 * 1024, proxy=None)
        except BaseException:
            self._stop()  # no chromium and no temp folder outlive a failed start
            raise
        self._ids = itertools.count(1)

    def _port(self, path: Path, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.proc.returncode}")
            try:
                return int(path.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                time.sleep(0.1)  # chromium has not written it yet
        raise RuntimeError("chromium did not open its DevTools port")

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        try:
            self.ws.close()
        finally:
            self._stop()

    def _stop(self) -> None:
        """End chromium (terminate, then kill) and remove its temp folder."""
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def send(self, method: str, **params: Any) -> dict[str, Any]:
        """One CDP command; returns its result (events in between are skipped)."""
        mid = next(self._ids)
        self.ws.send(json.dumps({"id": mid, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=60))
            if msg.get("id") == mid:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return dict(msg.get("result", {}))

    def goto(self, url: str) -> None:
        self.send("Page.enable")
        self.send("Page.navigate", url=url)

    def eval(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (promises awaited)."""
        res = self.send("Runtime.evaluate", expression=expression, returnByValue=True,
                        awaitPromise=True)
        if "exceptionDetails" in res:
            raise RuntimeError(f"{expression}: {res['exceptionDetails']}")
        return res.get("result", {}).get("value")

    def wait_for(self, expression: str, timeout: float = 60.0) -> Any:
        """Poll `expression` until it is truthy; returns its value."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            last = self.eval(expression)
            if last:
                return last
            time.sleep(0.2)
        raise AssertionError(f"not true within {timeout:.0f} s: {expression} (last {last!r})")

    def viewport(self, width: int, height: int, mobile: bool = False) -> None:
        self.send("Emulation.setDeviceMetricsOverride", width=width, height=height,
                  deviceScaleFactor=1, mobile=mobile)

    def screenshot(self, path: Path) -> Path:
        data = self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data["data"]))
        return path
