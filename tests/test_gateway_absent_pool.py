"""A model whose pool has no replica: asleep only where the pool may sleep (autoscaled with
`min: 0`, `sleeping_pools`); a fixed pool with none (a crash loop between replacements) is
down, and says so. A review as an SRE saw a crash-looping fixed pool answer sheddable
requests 503 "model is scaled to zero ... a standard or critical request [wakes it]".
A real gateway process with the spec's pool names in its settings and no engine."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx

from helpers import MODEL, Proc, gateway


def _gateway(tmp: Path, sleeping: list[str]) -> Proc:
    cfg = tmp / f"gw-{len(sleeping)}.json"
    cfg.write_text(
        json.dumps(
            {
                "pool_models": {"fallback": [MODEL]},
                "sleeping_pools": sleeping,
                "routes": {"sheddable": ["fallback"], "standard": ["fallback"]},
            }
        )
    )
    return gateway(tmp, args=("--config", str(cfg)), wait_ready=0)


def _post(url: str, priority: str) -> httpx.Response:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    headers = {"x-unbroken-priority": priority}
    return httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)


def test_a_pool_that_cannot_sleep_is_down_not_asleep(tmp_path: Path) -> None:
    g = _gateway(tmp_path, sleeping=[])
    try:
        # Within the grace a sheddable request is shed as ever; past it, 503 no_endpoint.
        deadline = time.monotonic() + 10
        while True:
            r = _post(g.url, "sheddable")
            err = r.json()["error"]
            assert err["code"] != "model_asleep", err
            if r.status_code == 503:
                break
            assert r.status_code == 429 and time.monotonic() < deadline, r.text
            time.sleep(0.5)
        assert err["code"] == "no_endpoint" and "no replica of its pool serves" in err["message"]
        # A standard request is told the same, not queued for the 30 s queue timeout.
        t0 = time.monotonic()
        r = _post(g.url, "standard")
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_endpoint", r.text
        assert time.monotonic() - t0 < 5
    finally:
        g.stop()


def test_a_pool_that_may_sleep_is_asleep(tmp_path: Path) -> None:
    g = _gateway(tmp_path, sleeping=["fallback"])
    try:
        r = _post(g.url, "sheddable")
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "model_asleep"
        assert r.headers["x-should-retry"] == "false"
    finally:
        g.stop()
