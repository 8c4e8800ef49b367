"""A client's bad gzip body is a 400 in OpenAI's format and one INFO line in the gateway's
log, not an aiohttp traceback at ERROR (issue 21, finding 9)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from helpers import engine, gateway


def test_bad_gzip_body_is_a_400_without_a_traceback(tmp_path: Path) -> None:
    e = engine(tmp_path)
    g = gateway(tmp_path, e.url)
    try:
        r = httpx.post(
            g.url + "/v1/completions",
            content=b"\x1f\x8bnot gzip at all" * 10,
            headers={"Content-Type": "application/json", "Content-Encoding": "gzip"},
            timeout=10,
        )
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["code"] == "invalid_body" and err["type"] == "invalid_request_error"
        time.sleep(0.5)  # aiohttp's lingering read, which logged the traceback, runs after
        log = g.log.read_text()
        assert "Traceback" not in log and "ERROR" not in log, log
        assert "unreadable request body" in log
    finally:
        g.stop()
        e.stop()
