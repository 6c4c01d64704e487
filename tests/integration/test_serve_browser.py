"""The chat page of `edge-agent serve` in Debian's headless Chromium: /?prompt=... sends the
prompt on load, streams the reply with fetch + ReadableStream and shows the request's stats.
The DOM holds the same text the API answers, streamed in several pieces, and the stats; the
screenshot has text drawn in the reply and stats boxes.

Deselected by default (marker `browser`); .ci/run installs chromium and runs it."""

import base64
import html
import json
import os
import re
import subprocess
import time
import urllib.parse
from pathlib import Path

import numpy as np
import pytest
from openai import OpenAI

from tests.integration.test_live_page_browser import read_png
from tests.serve_procs import SERVE_READY, serve_cmd, start, start_verifier
from tests.tiny_models import save_pair

pytestmark = pytest.mark.browser
CHROMIUM = Path("/usr/bin/chromium")
PROMPT, MAX_TOKENS = "w5 w9", 16
TEXT_RGB = (0x0F, 0x17, 0x2A)  # the page's text colour (body color)
MIN_TEXT_PIXELS = 40


class DevTools:
    """Headless Chromium driven over the DevTools protocol on --remote-debugging-pipe (its fds 3
    and 4: NUL-separated JSON). Virtual time (--dump-dom) does not wait for a streaming
    response body, so the page is watched in real time until it says it is done."""

    def __init__(self, profile: Path) -> None:
        to_chrome, self.out = os.pipe()
        self.inp, from_chrome = os.pipe()
        flags = [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={profile}",
            "--window-size=1100,900",
            "--remote-debugging-pipe",
        ]
        command = f'exec "$0" "$@" 3<&{to_chrome} 4>&{from_chrome}'  # bash: dash takes single-digit fds only
        self.proc = subprocess.Popen(
            ["bash", "-c", command, str(CHROMIUM), *flags, "about:blank"],
            pass_fds=(to_chrome, from_chrome),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_chrome)
        os.close(from_chrome)
        self.ids, self.buffer, self.session = 0, b"", None

    def call(self, method: str, **params: object) -> dict:
        self.ids += 1
        message = {"id": self.ids, "method": method, "params": params}
        if self.session and not method.startswith(("Target.", "Browser.")):
            message["sessionId"] = self.session
        os.write(self.out, json.dumps(message).encode() + b"\0")
        while True:
            while b"\0" not in self.buffer:
                data = os.read(self.inp, 1 << 20)
                assert data, "chromium closed the pipe"
                self.buffer += data
            raw, self.buffer = self.buffer.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self.ids:
                assert "error" not in reply, reply
                return reply["result"]  # type: ignore[no-any-return]

    def open(self, url: str) -> None:
        target = self.call("Target.createTarget", url=url)["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]

    def evaluate(self, expression: str) -> object:
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.evaluate(expression):
            assert time.monotonic() < deadline, f"{expression} never held"
            time.sleep(0.1)

    def close(self) -> None:
        try:
            self.call("Browser.close")
        finally:
            self.proc.wait(timeout=30)
            os.close(self.out)
            os.close(self.inp)


def _dark_pixels(png: Path, rect: list[int]) -> int:
    width, height, rows, bpp = read_png(png)
    pixels = np.frombuffer(b"".join(rows), dtype=np.uint8).reshape(height, width, bpp)[..., :3].astype(np.int16)
    x, y, w, h = rect
    area = pixels[y : y + h, x : x + w]
    return int((np.abs(area - np.array(TEXT_RGB, dtype=np.int16)) <= 40).all(axis=-1).sum())


def test_chat_page_streams_a_reply_with_its_stats(tmp_path: Path) -> None:
    if not CHROMIUM.exists():
        if os.environ.get("CI"):
            pytest.fail("chromium is missing: .ci/run installs it before the browser tests")
        pytest.skip("needs Debian's chromium (apt-get install -y chromium)")
    draft, target = save_pair(tmp_path / "models")
    verifier, address, _ = start_verifier(target, tmp_path / "verifier.log")
    served = start(serve_cmd(draft, address, "--k", "3"), tmp_path / "serve.log", SERVE_READY)
    try:
        base = served.match.group(1)
        api = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        reply = api.chat.completions.create(model="any", messages=[{"role": "user", "content": PROMPT}], max_tokens=MAX_TOKENS)
        url = f"{base}/?" + urllib.parse.urlencode({"prompt": PROMPT, "max_tokens": MAX_TOKENS})
        browser = DevTools(tmp_path / "profile")
        try:
            browser.open(url)
            browser.wait_for("['done', 'error'].includes(document.body.dataset.state)")
            dom = str(browser.evaluate("document.documentElement.outerHTML"))
            screenshot = tmp_path / "chat.png"
            screenshot.write_bytes(base64.b64decode(browser.call("Page.captureScreenshot", format="png")["data"]))
        finally:
            browser.close()
    finally:
        assert served.stop() == 0
        assert verifier.stop() == 0
    body = re.search(r"<body[^>]*>", dom)
    assert body, dom[:2000]
    assert 'data-state="done"' in body.group(0), dom[-3000:]
    chunks = re.search(r'data-chunks="(\d+)"', body.group(0))
    assert chunks and int(chunks.group(1)) >= 2  # streamed, not one piece
    text = re.search(r'<span id="text">([^<]*)</span>', dom)
    assert text and html.unescape(text.group(1)) == reply.choices[0].message.content
    assert re.search(r"<td>tau \(tokens per round\)</td><td>\d+\.\d+</td>", dom)
    assert re.search(r"<td>accepted / drafted</td><td>\d+ / \d+", dom) and "<td>speculation</td><td>ran" in dom
    rects = re.search(r'data-rects="([^"]*)"', body.group(0))
    assert rects
    for name, rect in json.loads(html.unescape(rects.group(1))).items():
        assert _dark_pixels(screenshot, rect) >= MIN_TEXT_PIXELS, name
