"""A paced rebalance (`POST /admin/endpoints/NAME/rebalance` with `batch`, `every_s`): the
streams leave in batches, not all at once (each continuation prefills its prompt and output
again on the next endpoint), and every one of them still finishes, byte-exact."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from helpers import MODEL, admin, engine, gateway, metric, stream, stream_text, wait_for
from unbroken.engine.textmodel import expected_completion


# serial: its windows count from the rebalance POST's reply; beside another test that reply
# came ~0.2 s after the first batch, and the '8 left' sample fell before the window (both
# parallel runs of 2026-12-03)
@pytest.mark.serial
def test_paced_rebalance_moves_streams_in_batches(tmp_path: Path) -> None:
    a = engine(tmp_path, name="a")
    b = engine(tmp_path, name="b")
    g = gateway(tmp_path, a.url, b.url)
    names = {e["url"]: e["name"] for e in admin(g, "GET", "/admin/endpoints").json()["endpoints"]}
    na, nb = names[a.url], names[b.url]
    results: list[bool] = []

    def user(i: int) -> None:
        prompt = f"paced move {i}"
        events, r = stream(
            g.url, "/v1/completions",
            {"model": MODEL, "prompt": prompt, "max_tokens": 1200, "temperature": 0},
        )  # fmt: skip
        want = expected_completion(prompt, 1200).text
        results.append(r.status_code == 200 and stream_text(events, chat=False) == want)

    def inflight(name: str) -> int:
        eps = admin(g, "GET", "/admin/endpoints").json()["endpoints"]
        return next(e["inflight"] for e in eps if e["name"] == name)

    threads = [threading.Thread(target=user, args=(i,)) for i in range(12)]
    try:
        admin(g, "PATCH", f"/admin/endpoints/{nb}", {"cap": 0})  # every stream starts on A
        for t in threads:
            t.start()
        wait_for(lambda: inflight(na) == 12, timeout=10, what="12 streams on A")
        admin(g, "PATCH", f"/admin/endpoints/{nb}", {"cap": None})
        r = admin(
            g, "POST", f"/admin/endpoints/{na}/rebalance",
            {"priorities": ["standard"], "batch": 4, "every_s": 0.4},
        )  # fmt: skip
        assert r.status_code == 200 and r.json()["moving"] == 12, r.text
        t0 = time.monotonic()
        seen = []
        while time.monotonic() - t0 < 1.6:
            seen.append((time.monotonic() - t0, inflight(na)))
            time.sleep(0.05)
        for t in threads:
            t.join(60)
        migrated = metric(g.url, "unbroken_gateway_streams_migrated_total", reason="rebalance")
    finally:
        for p in (g, a, b):
            p.stop()
    # A batch at once, the next 0.4 s later: 8 left after the first, 4 after the second.
    assert any(n == 8 for t, n in seen if 0.1 < t < 0.35), seen
    assert any(n == 4 for t, n in seen if 0.5 < t < 0.75), seen
    assert seen[-1][1] == 0, seen
    assert len(results) == 12 and all(results), results
    assert migrated == 12
