"""`unbroken bench` against an engine that is not the simulator: tokens counted from the
engine's usage (several per event), and verification against a reference engine or off with
the reason (a vLLM-shaped stand-in engine on real sockets, from test_gateway_tokens)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

from helpers import engine
from test_gateway_tokens import MODEL, FakeVllm
from unbroken.bench.load import LoadConfig, LoadRun


def _run(target: FakeVllm, reference: str | None) -> LoadRun:
    cfg = LoadConfig(
        url=target.url + "/v1",
        model=MODEL,
        users=3,
        spawn_rate=0,
        duration=1.5,
        max_tokens=(12, 12),
        reference_url=reference,
    )
    run = LoadRun(cfg)
    asyncio.run(run.run())
    return run


def test_tokens_come_from_usage_and_verification_is_off_without_a_reference() -> None:
    eng = FakeVllm(per_event=3)
    try:
        run = _run(eng, None)
    finally:
        eng.close()
    assert run.verify_mode == "off" and "--reference-url" in run.verify_note
    done = [r for r in run.records if r.outcome == "ok"]
    assert done and all(r.tokens == 12 for r in done)
    # 12 tokens in 4 events: one gap per token (the 2 others of each event are 0).
    assert all(len(r.gaps) == 11 and r.gaps.count(0.0) >= 8 for r in done)
    assert not [r for r in run.records if r.outcome == "corrupted"]


def test_verification_against_a_reference_engine() -> None:
    eng, ref, other = FakeVllm(), FakeVllm(), FakeVllm(per_event=1)
    try:
        run = _run(eng, ref.url)
        assert run.verify_mode == "reference"
        assert run.records and all(r.outcome == "ok" for r in run.records if r.end)
        # Each distinct request reaches the reference once, not once per stream.
        assert len(ref.bodies) == len(
            {(p, b.get("prompt") or str(b.get("messages"))) for p, b in ref.bodies}
        )
        # A reference that answers differently: every finished stream is corrupted.
        other.suffix = "!"
        bad = _run(eng, other.url)
        finished = [r for r in bad.records if r.outcome in ("ok", "corrupted")]
        assert finished and all(r.outcome == "corrupted" for r in finished)
    finally:
        for e in (eng, ref, other):
            e.close()


def test_scenario_on_your_own_engines_runs_your_command(tmp_path: Path) -> None:
    """No `unbroken up`: --scenario chaos runs --scenario-command at --at."""
    e = engine(tmp_path)
    marker = tmp_path / "chaos-ran"
    out = tmp_path / "out"
    try:
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "unbroken",
                "bench",
                "--url",
                e.url,
                "--scenario",
                "chaos",
                "--at",
                "0.5",
                "--duration",
                "2",
                "--users",
                "2",
                "--max-tokens",
                "8",
                "--scenario-command",
                f"touch {marker}",
                "--out",
                str(out),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        e.stop()
    assert r.returncode == 0, r.stdout + r.stderr
    assert marker.exists()
    data = json.loads((out / "results.json").read_text())
    assert [ev["event"] for ev in data["events"]][:1] == ["replica_killed"]
    assert "simulator" in data["meta"]["verification"]
    refused = subprocess.run(
        [sys.executable, "-m", "unbroken", "bench", "--url", e.url, "--scenario", "rollout"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2 and "--scenario-command" in refused.stderr + refused.stdout
