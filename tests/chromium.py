"""Headless Chromium for the tests that open pages in a real browser (the docs site's math,
the report page): the DOM after scripts ran, a screenshot, and every URL a page asked for.

Pages are served by a throw-away HTTP server on 127.0.0.1 so that the browser's net log
tells the page's own requests (initiator: the local origin) from the browser's background
traffic. Tests skip when no ``chromium`` is on PATH (Debian: ``apt-get install chromium``).
"""
from __future__ import annotations

import functools
import http.server
import json
import re
import shutil
import subprocess
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest

_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-sync",
          "--disable-background-networking", "--disable-component-update", "--disable-default-apps",
          "--disable-extensions", "--hide-scrollbars", "--virtual-time-budget=8000"]


def chromium() -> str:
    """The browser's executable, or skip the test."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("no headless Chromium on PATH (Debian: apt-get install chromium)")


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@contextmanager
def serve(folder: Path):
    """``http://127.0.0.1:<port>`` serving ``folder`` while the block runs."""
    handler = functools.partial(_Quiet, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _run(args: list[str], tmp: Path, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([chromium(), *_FLAGS, f"--user-data-dir={tmp / 'profile'}", *args],
                          capture_output=True, timeout=timeout, cwd=tmp)


def dump_dom(url: str, tmp: Path) -> tuple[str, list[str]]:
    """The page's DOM after its scripts ran, and the URLs the page itself requested."""
    netlog = tmp / "netlog.json"
    run = _run([f"--log-net-log={netlog}", "--dump-dom", url], tmp)
    assert run.returncode == 0, run.stderr.decode(errors="replace")[-2000:]
    return run.stdout.decode(), page_requests(netlog, url)


def screenshot(url: str, tmp: Path, size: str = "1200,1600") -> Path:
    """A PNG screenshot of the page."""
    out = tmp / "screenshot.png"
    run = _run([f"--screenshot={out}", f"--window-size={size}", url], tmp)
    assert run.returncode == 0 and out.is_file(), run.stderr.decode(errors="replace")[-2000:]
    return out


def page_requests(netlog: Path, url: str) -> list[str]:
    """URLs requested on behalf of the page at ``url``: every request of the net log whose
    initiator is the page's origin, or that went to another origin than the browser's own
    update / account services (requests with no origin at all)."""
    origin = re.match(r"[a-z]+://[^/]+", url).group(0)
    log = json.loads(netlog.read_text())
    names = {v: k for k, v in log["constants"]["logEventTypes"].items()}
    urls = []
    for event in log["events"]:
        if names.get(event["type"]) != "URL_REQUEST_START_JOB":
            continue
        params = event.get("params", {})
        if params.get("initiator") == origin or str(params.get("url", "")).startswith(origin):
            urls.append(params["url"])
    return urls


def visible_text(dom: str) -> str:
    """The text of a DOM outside scripts, styles, code and KaTeX's TeX annotations."""
    dom = re.sub(r"<(script|style|pre|code|annotation|textarea)\b.*?</\1>", " ", dom, flags=re.S | re.I)
    return re.sub(r"<[^>]+>", " ", dom)
