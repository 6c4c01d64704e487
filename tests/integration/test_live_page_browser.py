"""The live page in Debian's headless Chromium against a real verifier with traffic: the DOM
says every chart drew data, and the screenshot's pixels show each chart's colour.

Deselected by default (marker `browser`); .ci/run installs chromium and runs it."""

import asyncio
import html
import json
import os
import re
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from tests.ops import drive_traffic, running_servers

pytestmark = pytest.mark.browser
CHROMIUM = Path("/usr/bin/chromium")
# The series colours of cloud/static/index.html, one per chart (RGB).
# Each chart's canvas and its series colour in cloud/static/index.html (RGB).
CHART_COLOURS = {
    "c-rounds": (0x25, 0x63, 0xEB),
    "c-tau": (0x16, 0xA3, 0x4A),
    "c-accept": (0xF5, 0x9E, 0x0B),
    "c-latency": (0xDC, 0x26, 0x26),
}
MIN_PIXELS = 60  # a few seconds of a drawn series inside its canvas


async def _chromium(url: str, profile: Path, *mode: str) -> str:
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        "--window-size=1280,900",
        "--virtual-time-budget=5000",
    ]
    # An asyncio subprocess: the verifier answering the page runs on this very event loop.
    proc = await asyncio.create_subprocess_exec(
        str(CHROMIUM), *flags, *mode, url, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=120)
    assert proc.returncode == 0, err.decode(errors="replace")[-2000:]
    return out.decode(errors="replace")


def _unfilter(kind: int, line: bytearray, prev: bytes, bpp: int) -> None:
    """Undo one PNG row filter in place (RFC 2083 section 6)."""
    if kind == 2:
        line[:] = bytes((a + b) & 0xFF for a, b in zip(line, prev, strict=True))
        return
    for i in range(len(line)):
        left = line[i - bpp] if i >= bpp else 0
        up, corner = prev[i], (prev[i - bpp] if i >= bpp else 0)
        if kind == 1:
            line[i] = (line[i] + left) & 0xFF
        elif kind == 3:
            line[i] = (line[i] + (left + up) // 2) & 0xFF
        elif kind == 4:
            p = left + up - corner
            pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
            line[i] = (line[i] + (left if pa <= pb and pa <= pc else up if pb <= pc else corner)) & 0xFF


def read_png(path: Path) -> tuple[int, int, list[bytes], int]:
    """(width, height, rows, bytes per pixel) of an 8-bit RGB or RGBA, non-interlaced PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat = 8, b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", body)
        idat += body if kind == b"IDAT" else b""
        pos += 12 + length
    assert depth == 8 and colour in (2, 6) and interlace == 0
    bpp = 3 if colour == 2 else 4
    raw, stride = zlib.decompress(idat), width * bpp
    rows, prev = [], bytes(stride)
    for y in range(height):
        start = y * (stride + 1)
        line = bytearray(raw[start + 1 : start + 1 + stride])
        _unfilter(raw[start], line, prev, bpp)
        rows.append(prev := bytes(line))
    return width, height, rows, bpp


def colour_counts(path: Path, rects: dict[str, list[int]], tolerance: int = 24) -> dict[str, int]:
    """Per chart: pixels inside its canvas within `tolerance` of its colour, per channel."""
    width, height, rows, bpp = read_png(path)
    pixels = np.frombuffer(b"".join(rows), dtype=np.uint8).reshape(height, width, bpp)[..., :3].astype(np.int16)
    counts = {}
    for chart, rgb in CHART_COLOURS.items():
        x, y, w, h = rects[chart]
        area = pixels[y : y + h, x : x + w]
        counts[chart] = int((np.abs(area - np.array(rgb, dtype=np.int16)) <= tolerance).all(axis=-1).sum())
    return counts


def test_live_page_draws_populated_charts(target_model, draft_model, tmp_path: Path) -> None:
    if not CHROMIUM.exists():
        if os.environ.get("CI"):
            pytest.fail("chromium is missing: .ci/run installs it before the browser tests")
        pytest.skip("needs Debian's chromium (apt-get install -y chromium)")
    screenshot = tmp_path / "live-page.png"

    async def run() -> str:
        async with running_servers(target_model) as (servers, loading):
            await loading
            url = f"http://127.0.0.1:{servers.http.port}/"
            await drive_traffic(servers.grpc_port, draft_model, seconds=6)
            during = asyncio.create_task(drive_traffic(servers.grpc_port, draft_model, seconds=6, seed=1))
            dom = await _chromium(url, tmp_path / "profile-dom", "--dump-dom")
            await _chromium(url, tmp_path / "profile-shot", f"--screenshot={screenshot}")
            await during
            return dom

    dom = asyncio.run(run())
    body = re.search(r"<body[^>]*>", dom)
    assert body, dom[:2000]
    populated = re.search(r'data-populated="([^"]*)"', body.group(0))
    refreshes = re.search(r'data-refreshes="(\d+)"', body.group(0))
    assert populated and set(populated.group(1).split(",")) == {"rounds", "tau", "acceptance", "latency"}
    assert refreshes and int(refreshes.group(1)) >= 2  # refreshed every second, not drawn once
    assert 'id="status" class="ready"' in dom
    rects = re.search(r'data-chart-rects="([^"]*)"', body.group(0))
    assert rects
    # Same window size in both runs, so the same layout: the DOM run says where the charts are.
    counts = colour_counts(screenshot, json.loads(html.unescape(rects.group(1))))
    assert all(n >= MIN_PIXELS for n in counts.values()), counts
