"""`unbroken bench --rate`: the open loop (bench/load.py). Requests arrive at the rate asked
whether or not earlier ones have ended (Poisson or evenly spaced), `--max-concurrency` caps
what is open and the wait for a slot is recorded, a multi-turn conversation never has two
turns open at once, and the command refuses a closed loop's options with an open loop's.
Against one real simulator process."""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import re
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from rich.console import Console

from helpers import Proc, engine
from unbroken.bench.cli_run import BenchOptionError, BenchOptions, run
from unbroken.bench.load import LoadConfig, LoadRun
from unbroken.bench.workloads import MultiTurn


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Proc:
    e = engine(tmp_path_factory.mktemp("rate"), "--decode-base-s", "0.01")
    yield e
    e.stop()


def _run(cfg: LoadConfig) -> LoadRun:
    run = LoadRun(cfg)
    asyncio.run(run.run())
    return run


def _gaps(run: LoadRun) -> list[float]:
    starts = sorted(r.start for r in run.records)
    return [b - a for a, b in itertools.pairwise(starts)]


def test_poisson_arrivals_do_not_wait_for_answers(sim: Proc) -> None:
    """50 requests a second of 40 tokens at 10 ms a step (~0.4 s each): ~20 open at once,
    where a closed loop's users would each wait for their answer."""
    run = _run(LoadConfig(url=sim.url, rate=50.0, duration=3.0, max_tokens=(40, 40)))
    n = len(run.records)
    assert 100 <= n <= 200, n  # 150 expected; a Poisson count's sd is ~12
    assert {r.outcome for r in run.records} == {"ok"}
    assert run.max_active >= 10 and run.unsent == 0
    # No cap: each is sent at its arrival (the wait is the generator's own lateness).
    assert max(r.wait for r in run.records) < 0.05
    gaps = _gaps(run)
    # Exponential gaps: their spread is about their mean.
    assert statistics.pstdev(gaps) / statistics.mean(gaps) > 0.6
    # Seeded: the same arrivals again.
    assert _gaps(_run(LoadConfig(url=sim.url, rate=50.0, duration=1.0, max_tokens=(4, 4))))[
        :20
    ] == pytest.approx(
        _gaps(_run(LoadConfig(url=sim.url, rate=50.0, duration=1.0, max_tokens=(4, 4))))[:20],
        abs=0.02,
    )


def test_constant_arrivals_are_evenly_spaced(sim: Proc) -> None:
    run = _run(
        LoadConfig(url=sim.url, rate=20.0, arrival="constant", duration=2.0, max_tokens=(8, 8))
    )
    gaps = _gaps(run)
    assert 35 <= len(run.records) <= 41, len(run.records)
    assert statistics.median(gaps) == pytest.approx(0.05, abs=0.005)
    assert statistics.pstdev(gaps) < 0.015


def test_max_concurrency_caps_open_requests_and_records_the_wait(sim: Proc) -> None:
    run = _run(
        LoadConfig(
            url=sim.url,
            rate=40.0,
            arrival="constant",
            max_concurrency=2,
            duration=2.0,
            max_tokens=(16, 16),
        )
    )
    assert run.max_active == 2
    assert {r.outcome for r in run.records} == {"ok"}
    waits = sorted(r.wait for r in run.records)
    # Each request takes ~0.17 s and two run at once: ~12 a second leave against 40
    # arriving, so the queue and its wait grow through the run; the rest are never sent.
    assert waits[0] < 0.05 and waits[-1] > 0.5
    assert len(run.records) < 40 and run.unsent > 20


def test_a_conversation_never_has_two_turns_open(sim: Proc) -> None:
    spec = MultiTurn(num_turns=3, system_prompt_len=20, question_len=6, output_len=12)
    run = _run(LoadConfig(url=sim.url, rate=30.0, duration=2.0, workload=spec))
    assert {r.outcome for r in run.records} == {"ok"}  # every reply verified
    by_session: dict[str | None, list[tuple[float, float, int]]] = defaultdict(list)
    for r in run.records:
        assert r.end is not None
        by_session[r.session].append((r.start, r.end, r.turn))
    assert len(by_session) >= 3  # more than one conversation ran at once
    assert any(len(turns) >= 2 for turns in by_session.values())
    for turns in by_session.values():
        turns.sort()
        for (_, end, turn), (start, _, nxt) in itertools.pairwise(turns):
            # (a finished conversation's slot starts the next one, turn 0 again)
            assert start >= end and nxt == (turn + 1) % 3


def test_a_sweep_offers_each_rate_in_turn(sim: Proc) -> None:
    """`--rate 10,40`: the first half of the run at 10 a second, the second at 40."""
    run = _run(LoadConfig(url=sim.url, rate=10.0, sweep=(10.0, 40.0), duration=3.0,
                          max_tokens=(4, 4)))  # fmt: skip
    first = sum(r.start < 1.5 for r in run.records)
    second = len(run.records) - first
    # 15 and 60 expected (Poisson counts; a loaded generator sends the second a little late)
    assert 5 <= first <= 27 and 30 <= second <= 85 and second > 2 * first, (first, second)
    marks = [(e["t"], e["rate"]) for e in run.events if e["event"] == "rate"]
    assert [r for _, r in marks] == [10.0, 40.0] and 1.3 < marks[1][0] < 1.7, marks


def test_bench_cli_open_loop(sim: Proc, tmp_path: Path) -> None:
    def bench(*args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "unbroken", "bench", "--url", sim.url, "--out"]
        argv += [str(tmp_path), "--max-tokens", "4", "--duration", "1.5", *args]
        return subprocess.run(argv, capture_output=True, text=True, timeout=60)

    r = bench("--rate", "20", "--max-concurrency", "8")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout + r.stderr
    assert "open loop: 20 requests/s offered (poisson arrivals)" in out
    assert "--max-concurrency 8: waited for a slot p50" in out
    raw = json.loads((tmp_path / "results.json").read_text())
    cfg = raw["config"]
    assert cfg["rate"] == 20 and cfg["max_concurrency"] == 8 and "users" not in cfg
    assert raw["meta"]["load"].startswith("open loop: 20 requests/s")
    summary = raw["windows"]["whole run"]["summary"]
    assert 8 <= summary["requests_per_s"] <= 40 and "wait" in summary
    # The closed loop's results keep their settings, without the open loop's.
    r = bench("--users", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    cfg = json.loads((tmp_path / "results.json").read_text())["config"]
    assert cfg["users"] == 2 and "rate" not in cfg and "max_concurrency" not in cfg
    # A sweep: a row per rate, and a window each in the report.
    r = bench("--rate", "5,20")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout + r.stderr
    assert "open loop: 5, 20 requests/s in turn, 0.75 s each offered" in out
    rows = [ln for ln in out.splitlines() if ln.startswith(("| 5 |", "| 20 |"))]
    assert len(rows) == 2, out
    windows = json.loads((tmp_path / "results.json").read_text())["windows"]
    assert {"rate 5/s", "rate 20/s"} <= windows.keys()
    r = bench("--rate", "10", "--users", "5")
    assert r.returncode == 2 and "--users: the closed loop's" in r.stderr, r.stderr
    # The rest of the refusals in-process (the options' checks come before any request).
    console = Console(file=io.StringIO())
    for bad, said in (
        ({"rate": 10, "spawn_rate": 5}, "--spawn-rate: the closed loop's"),
        ({"max_concurrency": 4}, "--max-concurrency caps an open loop"),
        ({"arrival": "constant"}, "--arrival is --rate's"),
        ({"rate": 0}, "--rate must be requests per second"),
        ({"rate": float("inf")}, "--rate must be requests per second"),
        ({"rate": 5, "arrival": "bursty"}, "--arrival must be poisson or constant"),
        ({"rate": 5, "max_concurrency": 0}, "--max-concurrency must be at least 1"),
        ({"users": 0}, "--users must be at least 1"),
        ({"rate": "5,x"}, "--rate: 'x' is not a number"),
        ({"rate": "5,-1"}, "--rate must be requests per second"),
        ({"rate": "5,10", "scenario": "rollout"}, "a rate sweep (--rate 5,10) runs no scenario"),
    ):
        with pytest.raises(BenchOptionError, match=re.escape(said)):
            run(BenchOptions(url=sim.url, out=tmp_path, **bad), console)  # type: ignore[arg-type]
