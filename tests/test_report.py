"""The bench report: self-contained HTML with real tables, verdict colours, run metadata and
plots that carry the windows and markers; checked in headless Chromium (Debian's package)
over the DevTools protocol: every image decodes, the tables are there, nothing is logged as
an error, and a screenshot is kept for a human to look at."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from unbroken.bench.load import Record
from unbroken.bench.report import Marker, Span, run_metadata, write_report
from unbroken.bench.runner import make_window
from unbroken.wire.http import free_port

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _records() -> list[Record]:
    recs = []
    for i in range(400):
        start = i * 0.1
        slow = 20 <= start < 26  # the "rollout" bumps TTFT
        outcome = "dropped" if i == 250 else "error" if i == 300 else "ok"
        recs.append(
            Record(
                user=i % 20,
                kind="chat" if i % 2 else "completion",
                priority="standard",
                slow=False,
                start=start,
                max_tokens=20,
                status=500 if outcome == "error" else 200,
                ttft=None if outcome == "error" else (0.09 if slow else 0.03) + (i % 7) * 0.002,
                end=start + 0.5,
                tokens=0 if outcome == "error" else 20,
                gaps=[] if outcome == "error" else [0.02 + (i % 5) * 0.001] * 19,
                outcome=outcome,
                detail="HTTP 500" if outcome == "error" else None,
            )
        )
    return recs


def _samples() -> list[dict[str, Any]]:
    return [
        {
            "t": t / 2,
            "endpoints": {
                "primary-1": {"inflight": 10 + t % 3, "state": "ready", "pool": "primary"},
                "primary-2": {"inflight": 8, "state": "ready", "pool": "primary"},
            },
            "queue": {"critical": 0, "standard": t % 4, "sheddable": 0},
            "counters": {"migrated": float(t // 20), "dropped": 0.0},
        }
        for t in range(84)
    ]


def make_report(out: Path) -> Path:
    recs = _records()
    windows = {
        "steady": make_window(recs, 5, 20),
        "rollout": make_window(recs, 20, 26),
        "whole run": make_window(recs, 0, 41),
    }
    return write_report(
        out,
        title="unbroken demo (test)",
        config={"users": 20},
        records=recs,
        events=[
            {"t": 20.0, "event": "rollout_start", "pool": "primary"},
            {"t": 20.4, "event": "surge primary-3"},
            {"t": 26.0, "event": "rollout_end", "ok": True},
        ],
        samples=_samples(),
        windows=windows,
        markdown="Pipeline start: 3.1 s.\n\n| window | x |\n|---|---|\n| steady | 1 |\n\n"
        "Footnote of the window table.\n\n| p99.9 TTFT ratio | 3.1x | <= 1.5x | FAIL |\n\n"
        "- first note\n- second note\n",
        spans=[
            Span("steady", 5, 20),
            Span("rollout", 20, 26),
            {"name": "chaos", "start": 30, "end": 35},
        ],
        markers=[
            Marker(20.0, "rollout_start"),
            Marker(20.4, "surge primary-3"),
            {"t": 20.9, "label": "controller: primary-1 contended"},
            Marker(26.0, "rollout_end"),
        ],
        checks=[
            {
                "metric": "dropped streams in rollout",
                "measured": "0 of 60",
                "target": "0",
                "ok": True,
            },
            {"metric": "p99.9 TTFT ratio", "measured": "3.1x", "target": "<= 1.5x", "ok": False},
        ],
        seed_table=[
            {"metric": "p99.9 TTFT in rollout", "standard": 840.0, "unbroken": 110.3, "unit": "ms"},
            {"metric": "dropped streams", "standard": 41, "unbroken": 0, "unit": "streams"},
        ],
        meta=run_metadata(command="unbroken demo --users 20", extra={"spec": "default"}),
    )


def test_report_is_self_contained_html_with_tables(tmp_path: Path) -> None:
    path = make_report(tmp_path)
    page = path.read_text()
    # Images are embedded; no file beside the page is needed to show them.
    imgs = re.findall(r'<img src="([^"]+)"', page)
    assert len(imgs) == 6 and all(i.startswith("data:image/png;base64,") for i in imgs)
    for name in ("ttft.png", "itl.png", "broken.png", "streams.png", "queue.png", "tokens.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert "<pre>|" not in page and "<table>" in page  # real tables, not Markdown in <pre>
    # Verdict rows coloured; the seed table and the metadata are there.
    assert page.count('<td class="fail">FAIL</td>') == 1 and '<td class="pass">pass</td>' in page
    assert "<ul><li>first note</li><li>second note</li></ul>" in page
    assert "p99.9 TTFT in rollout" in page and "840.0" in page
    assert "unbroken demo --users 20" in page and "unbroken</dt>" in page
    # The error column counts by status; a dropped stream is flagged.
    assert "HTTP 500: 1" in page and 'class="num bad">1 of' in page
    # The markdown window table is not repeated (the windows table replaces it).
    assert page.count("<th>window</th>") == 1
    assert "Pipeline start: 3.1 s." in page and "Footnote of the window table" not in page
    # Markers are numbered on the plots and listed in order, with their full labels.
    assert "<h2>Markers on the plots</h2>" in page
    assert page.index("controller: primary-1 contended") < page.index("<h2>Events</h2>")
    # A markdown table repeating the verdict rows is not shown twice; its bullets are a list.
    data = json.loads((tmp_path / "results.json").read_text())
    assert [s["name"] for s in data["spans"]] == ["steady", "rollout", "chaos"]
    assert data["seed_table"][1]["standard"] == 41 and len(data["records"]) == 400


def test_report_defaults_spans_and_markers_from_windows_and_events(tmp_path: Path) -> None:
    recs = _records()
    write_report(
        tmp_path,
        title="t",
        config={},
        records=recs,
        events=[{"t": 1.0, "event": "rollout_start"}],
        samples=[],
        windows={"steady": make_window(recs, 0, 10), "whole run": make_window(recs, 0, 41)},
    )
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["spans"] == [{"name": "steady", "start": 0, "end": 10}]
    assert data["markers"] == [{"t": 1.0, "label": "rollout_start"}]
    assert not (tmp_path / "streams.png").exists()  # no gateway samples, no per-endpoint plot


class _DevTools:
    """The smallest Chrome DevTools Protocol client: one page, commands and events."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.n = 0
        self.events: list[dict[str, Any]] = []

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.n += 1
        await self.ws.send_json({"id": self.n, "method": method, "params": params})
        while True:
            msg = json.loads((await self.ws.receive(timeout=30)).data)
            if msg.get("id") == self.n:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]
            self.events.append(msg)


async def _inspect(port: int, url: str, shot: Path) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s:
        deadline = time.monotonic() + 30
        while True:
            try:
                async with s.get(f"http://127.0.0.1:{port}/json/list") as r:
                    pages = [p for p in await r.json() if p["type"] == "page"]
                if pages:
                    break
            except aiohttp.ClientError:
                pass
            assert time.monotonic() < deadline, "Chromium's DevTools endpoint never answered"
            await asyncio.sleep(0.2)
        async with s.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0) as ws:
            dt = _DevTools(ws)
            await dt.call("Runtime.enable")
            await dt.call("Log.enable")
            await dt.call("Page.enable")
            await dt.call(
                "Emulation.setDeviceMetricsOverride",
                width=1280,
                height=2400,
                deviceScaleFactor=1,
                mobile=False,
            )
            await dt.call("Page.navigate", url=url)
            for _ in range(100):
                res = await dt.call(
                    "Runtime.evaluate", expression="document.readyState", returnByValue=True
                )
                if res["result"]["value"] == "complete":
                    break
                await asyncio.sleep(0.1)
            probe = """JSON.stringify({
                tables: document.querySelectorAll('table').length,
                rows: document.querySelectorAll('tbody tr').length,
                failCells: document.querySelectorAll('td.fail').length,
                failColor: (c => c && getComputedStyle(c).backgroundColor)(
                    document.querySelector('td.fail')),
                images: [...document.images].map(
                    i => [i.complete, i.naturalWidth, i.naturalHeight]),
                title: document.title,
                width: document.documentElement.scrollWidth,
            })"""
            res = await dt.call("Runtime.evaluate", expression=probe, returnByValue=True)
            info = json.loads(res["result"]["value"])
            png = await dt.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
            shot.write_bytes(base64.b64decode(png["data"]))
            info["errors"] = [
                e
                for e in dt.events
                if e.get("method") == "Runtime.exceptionThrown"
                or (
                    e.get("method") == "Log.entryAdded" and e["params"]["entry"]["level"] == "error"
                )
            ]
            return info


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
def test_report_renders_in_headless_chromium(tmp_path: Path) -> None:
    path = make_report(tmp_path / "report")
    port = free_port()
    profile = tempfile.mkdtemp(prefix="chromium-", dir=tmp_path)
    assert CHROMIUM is not None
    proc = subprocess.Popen(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            f"--user-data-dir={profile}",
            f"--remote-debugging-port={port}",
            "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    shot = tmp_path / "report.png"
    try:
        info = asyncio.run(_inspect(port, path.as_uri(), shot))
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    keep = os.environ.get("UNBROKEN_KEEP_SCREENSHOT")
    if keep:
        shutil.copy(shot, keep)
    assert info["errors"] == []
    assert info["title"] == "unbroken demo (test)"
    assert info["tables"] >= 5 and info["rows"] >= 10
    assert info["failCells"] == 1 and info["failColor"] == "rgb(255, 227, 227)"
    assert len(info["images"]) == 6
    for complete, w, h in info["images"]:
        assert complete and w == 1100 and h > 250  # decoded at the plots' real size
    assert info["width"] <= 1280  # no horizontal scrolling at a laptop's width
    assert shot.stat().st_size > 50_000
