"""`unbroken reload` of an autoscaled pool's cap and `scaling` together (a review as an SRE):
the cap was applied and `scaling.target` listed as "not applied", which left the pool in the
state the spec check refuses (a target above its cap): demand never reached the target, the
pool never scaled out and requests timed out in the gateway's queue. Now both are applied in
one step, and the autoscaler (the controller, from the supervisor's `GET /pools`) scales on
the new target. Real pipeline, real processes."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx

from helpers import MODEL, Up, wait_for

SPEC = """
model: {model}
pools:
  - name: main
    replicas: {{min: 1, max: 2}}
    cap: {cap}
    scaling: {{target: {target}, up_cooldown_s: 1, down_quiet_s: 600}}
    weights_size: 8MiB
    engine: {{profile: fp16, overrides: {{decode_base_s: 0.01}}}}
"""


def _write(path: Path, cap: int, target: int) -> None:
    path.write_text(SPEC.format(model=MODEL, cap=cap, target=target))


def _live(up: Up) -> int:
    return int(up.status()["pools"]["main"]["live"])


def test_reload_applies_a_pools_cap_and_target_together(tmp_path: Path) -> None:
    spec = tmp_path / "pipeline.yaml"
    _write(spec, cap=8, target=6)
    up = Up(tmp_path, spec)
    stop = threading.Event()
    try:
        wait_for(lambda: _live(up) == 1, timeout=60, what="one replica serving")
        _write(spec, cap=2, target=2)
        r = up.run("reload", timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        changed, _, rest = r.stdout.partition("not applied")
        assert "pools.main.cap: 8 -> 2" in changed, r.stdout
        assert "pools.main.scaling.target: 6.0 -> 2.0" in changed, r.stdout
        assert "scaling" not in rest, r.stdout

        # Four streams at a time: 4 / target 2 wants the second replica (with the target
        # left at 6, 4 / 6 wanted one, and the cap of 2 queued the other two).
        def stream_forever() -> None:
            body: dict[str, Any] = {"model": MODEL, "prompt": "load", "max_tokens": 300}
            while not stop.is_set():
                try:
                    httpx.post(up.url + "/v1/completions", json=body, timeout=60)
                except httpx.HTTPError:
                    pass

        threads = [threading.Thread(target=stream_forever, daemon=True) for _ in range(4)]
        for t in threads:
            t.start()
        wait_for(lambda: _live(up) == 2, timeout=60, what="the pool scaled out to 2")
    finally:
        stop.set()
        assert up.stop() == 0


def test_a_reload_report_says_a_rollout_is_not_in_the_file() -> None:
    """After a rollout, the pool's engine differs from the file; the report listed it as a
    change a restart would apply (a review as a new user), where a restart would undo the
    rollout."""
    from unbroken.pipeline.up import reload_lines

    res: dict[str, Any] = {"gateway_pid": 1, "generation": 2, "spec": None, "changed": []}
    engine = {"key": "pools.primary.engine.overrides.decode_base_s", "old": 0.018, "new": None}
    lines = reload_lines({**res, "not_applied": [engine]})
    assert any("not written back to the spec" in ln for ln in lines), lines
    other = {"key": "pools.spare.replicas", "old": 1, "new": 2}
    assert not any("written back" in ln for ln in reload_lines({**res, "not_applied": [other]}))
