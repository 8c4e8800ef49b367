"""What admission costs a request (acquire + release, in process), with the fair-share reserve
and, with `--before SRC`, the same cases run from another source tree in the same run (e.g.
`git archive COMMIT src | tar -x -C DIR`, then `--before DIR/src`).

Cases: no tenant; one tenant alone; two tenants active with the one measured over its share
of a pool with free slots left (the reserve's whole check: the pool's room, the shares); each
in one process and as a worker over the shared tables (`SharedCounters`, what `--workers N`
runs). Rows: microseconds per acquire + release (best of `--repeat` passes), and the ratio
to the before tree's.

    python benchmarks/fairness_cost.py [--n 20000] [--before SRC]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

CASES = ("no tenant", "one tenant", "two tenants, over its share")


def measure(n: int, repeat: int) -> dict[str, float]:
    """Per case and mode: microseconds per acquire + release in this interpreter's tree."""
    from unbroken.gateway._admission import Admission
    from unbroken.gateway._pool import Endpoint, Pool, State
    from unbroken.gateway._shared import SharedCounters, SharedSlot

    out: dict[str, float] = {}
    tmp = Path(tempfile.mkdtemp(prefix="unbroken-fair-cost-"))
    for mode in ("one process", "workers"):
        for case in CASES:
            shared = None
            if mode == "workers":
                path = tmp / f"adm-{case.replace(' ', '_').replace(',', '')}"
                SharedCounters(path, create=True).close()
                shared = SharedCounters(path, row=0)
            pool = Pool(default_cap=64)
            ep = Endpoint(name="e", url="http://e")
            ep.models = {"m"}
            ep.set_state(State.READY)
            if shared is not None:
                ep.slot = SharedSlot(shared, 0)
            pool.add(ep)
            adm = Admission(pool, queue_timeout=5.0, shared=shared)

            async def run(adm: Admission = adm, case: str = case) -> float:
                tenant = None if case == "no tenant" else "greedy"
                held = []
                if case.startswith("two"):
                    # light active (one request), greedy holding 40 of 64: over its share 32,
                    # with room left, so every request makes the whole check and is let in.
                    e, k, _ = await adm.acquire("m", "standard", tenant="light")
                    adm.release(e, k)
                    held = [await adm.acquire("m", "standard", tenant="greedy") for _ in range(40)]
                best = float("inf")
                for _ in range(repeat):
                    t0 = time.perf_counter()
                    for _ in range(n):
                        e, k, _ = await adm.acquire("m", "standard", tenant=tenant)
                        adm.release(e, k)
                    best = min(best, time.perf_counter() - t0)
                for e, k, _ in held:
                    adm.release(e, k)
                return best / n * 1e6

            out[f"{mode}|{case}"] = asyncio.run(run())
    for light in (False, True):
        out[f"one process|release + wake, 270 waiters{', light active' if light else ''}"] = (
            asyncio.run(backlog(light, n // 20))
        )
    return out


async def backlog(light: bool, rounds: int) -> float:
    """Microseconds per release of a greedy slot while 270 greedy requests wait (the wake
    that hands it on included), the pool full (32); `light`: another tenant active."""
    from unbroken.gateway._admission import Admission
    from unbroken.gateway._pool import Endpoint, Pool, State

    pool = Pool(default_cap=32)
    ep = Endpoint(name="e", url="http://e")
    ep.models = {"m"}
    ep.set_state(State.READY)
    pool.add(ep)
    adm = Admission(pool, queue_timeout=600.0, max_queue=10_000)

    def greedy() -> asyncio.Task[tuple[Endpoint, int, float]]:
        return asyncio.create_task(adm.acquire("m", "standard", tenant="greedy"))

    if light:
        e, k, _ = await adm.acquire("m", "standard", tenant="light")
        adm.release(e, k)
    held = [await adm.acquire("m", "standard", tenant="greedy") for _ in range(31 if light else 32)]
    tasks = [greedy() for _ in range(270)]
    await asyncio.sleep(0.05)
    spent = 0.0
    for _ in range(rounds):
        e, k, _ = held.pop(0)
        t0 = time.perf_counter()
        adm.release(e, k)
        spent += time.perf_counter() - t0
        await asyncio.sleep(0)
        for t in [t for t in tasks if t.done()]:
            tasks.remove(t)
            held.append(t.result())
            tasks.append(greedy())
        await asyncio.sleep(0)
    for t in tasks:
        t.cancel()
    return spent / rounds * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--before", help="a source tree (its src/) to measure too")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.json:
        print(json.dumps(measure(args.n, args.repeat)))
        return

    def child(src: str | None) -> dict[str, float]:
        env = {**os.environ, **({"PYTHONPATH": src} if src else {})}
        argv = [sys.executable, __file__, "--json", "--n", str(args.n), "--repeat"]
        res = subprocess.run([*argv, str(args.repeat)], env=env, capture_output=True, check=True)
        return json.loads(res.stdout)  # type: ignore[no-any-return]

    from _common import table

    # Alternated, so that a change in the machine's load hits both alike.
    now, before = child(None), child(args.before) if args.before else None
    if args.before:
        now2, before2 = child(None), child(args.before)
        now = {k: min(v, now2[k]) for k, v in now.items()}
        before = {k: min(v, before2[k]) for k, v in before.items()}  # type: ignore[union-attr]
    rows = []
    for key, us in now.items():
        mode, case = key.split("|")
        row = [mode, case, f"{us:.2f}"]
        if before is not None:
            row += [f"{before[key]:.2f}", f"{us / before[key]:.2f}x"]
        rows.append(row)
    head = ["mode", "case", "us per request"]
    if before is not None:
        head += ["before", "ratio"]
    print(table(head, rows))


if __name__ == "__main__":
    main()
