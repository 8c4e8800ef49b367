"""CPU per streamed token of the load generator (`bench/load.py`: the client of `unbroken demo`
and `unbroken bench`), on asyncio's default event loop against uvloop.

On a small machine the load generator shares the cores with the gateway and engines it
measures, so what it spends per token is taken from them. One simulator engine; each pass
runs `--users` closed-loop streaming users for `--seconds` in this process and reads its own
CPU (time.process_time) over the pass. The passes alternate (asyncio, uvloop, asyncio, ...)
so that drift hits both; medians of `--repeats` each; ratio is uvloop / asyncio.
`python benchmarks/loadgen_cpu.py [--users 150 --seconds 12 --repeats 2]`
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import uvloop

from _common import engine_service, median, table, wait_http
from unbroken.bench.load import LoadConfig, LoadRun

Runner = Callable[[Coroutine[Any, Any, tuple[float, int]]], tuple[float, int]]


async def _pass(url: str, users: int, seconds: float) -> tuple[float, int]:
    run = LoadRun(LoadConfig(url=url, users=users, spawn_rate=100.0, duration=seconds))
    c0 = time.process_time()
    await run.run()
    cpu = time.process_time() - c0
    bad = [r for r in run.records if r.outcome != "ok"]
    if bad:
        raise SystemExit(f"{len(bad)} request(s) did not complete: {bad[0].detail}")
    return cpu, sum(r.tokens for r in run.records)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--users", type=int, default=150)
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    loops: dict[str, Runner] = {"asyncio": asyncio.run, "uvloop": uvloop.run}
    eng = engine_service("--served-model-name", "unbroken-sim")
    per_token: dict[str, list[float]] = {k: [] for k in loops}
    tokens: dict[str, list[int]] = {k: [] for k in loops}
    with tempfile.TemporaryDirectory() as tmp:
        eng.start(Path(tmp), "engine")
        try:
            asyncio.run(wait_http(eng.url + "/health"))
            for i in range(a.repeats):
                for name, run in loops.items():
                    cpu, n = run(_pass(eng.url, a.users, a.seconds))
                    per_token[name].append(1e6 * cpu / n)
                    tokens[name].append(n)
                    print(f"pass {i + 1} {name}: {cpu:.2f} s CPU, {n} tokens", file=sys.stderr)
        finally:
            eng.stop()
    base = median(per_token["asyncio"])
    rows = [
        [
            name,
            f"{median(tokens[name]):.0f}",
            f"{median(per_token[name]):.1f}",
            f"{median(per_token[name]) / base:.2f}",
        ]
        for name in loops
    ]
    print(
        f"load generator CPU per token, {a.users} users, {a.seconds:.0f} s passes, "
        f"median of {a.repeats}"
    )
    print(table(["event loop", "tokens per pass", "us CPU per token", "ratio"], rows))


if __name__ == "__main__":
    main()
