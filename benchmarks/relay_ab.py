"""Two gateway versions relaying at the same time, from one engine, under one load: the CPU
per relayed chunk of each, paired.

`gateway_overhead.py` measures its targets one after another; on a shared 2-core machine the
load of the other processes moves between passes, and with it how many events an engine
step puts in one read (the cost per chunk falls as reads batch). Here both gateways run
side by side for the whole window: each gets `--streams` closed-loop streams from the same
simulated engine at once, so both see the same engine steps and the same machine. The
ratio is new / old per pass; the table prints every pass and the median.

    python benchmarks/relay_ab.py --old /path/to/other/tree/src [--streams 64] [--workers 1]

`--old` is the `src/` directory of another version (e.g. `git worktree add /tmp/old
HEAD~3`); the new one is this tree.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _common import gateway_service, median, table, tree_cpu_seconds, wait_http
from gateway_overhead import ITL_S, SETTLE_S, bench_engine, closed_loop, raise_fd_limit


async def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--old", required=True, help="src/ of the other version")
    ap.add_argument("--streams", type=int, default=64, help="per gateway")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    raise_fd_limit()
    logs = Path(tempfile.mkdtemp(prefix="ub-relay-ab-"))
    both = 2 * args.streams
    eng = bench_engine(both, args.max_tokens).start(logs, "engine")
    cap = ("--cap", str(4 * both), "--workers", str(args.workers))
    env = {"UNBROKEN_ADMIN_TOKEN": "bench"}
    new, _ = gateway_service(eng.url, args=cap)
    old, _ = gateway_service(eng.url, args=cap)
    new.start(logs, "new", env=env)
    old.start(logs, "old", env={**env, "PYTHONPATH": args.old})
    rows = []
    ratios = []
    try:
        for s in (eng, new, old):
            await wait_http(s.url + "/health")
        await asyncio.sleep(2.5)
        assert new.proc and old.proc
        ramp = args.max_tokens * ITL_S
        for i in range(args.passes):
            c0 = {"new": tree_cpu_seconds(new.proc.pid), "old": tree_cpu_seconds(old.proc.pid)}
            t0 = time.monotonic()
            runs = await asyncio.gather(
                *(
                    closed_loop(s.url, args.streams, args.duration, args.max_tokens, ramp, 0.0)
                    for s in (new, old)
                )
            )
            wall = time.monotonic() - t0
            out = {}
            for name, s, run in (("new", new, runs[0]), ("old", old, runs[1])):
                assert s.proc
                cpu = tree_cpu_seconds(s.proc.pid) - c0[name]
                chunks = sum(r.tokens for r in run.records)
                failed = sum(r.outcome != "ok" for r in run.records)
                out[name] = cpu / chunks * 1e6 if chunks else float("nan")
                rows.append([str(i + 1), name, f"{out[name]:.1f}", str(chunks), str(failed)])
            ratios.append(out["new"] / out["old"])
            rows[-1].append(f"{ratios[-1]:.2f}x")
            rows[-2].append("")
            print(f"pass {i + 1}: {wall:.0f} s, new/old {ratios[-1]:.2f}x", file=sys.stderr)
            await asyncio.sleep(SETTLE_S)
    finally:
        new.stop()
        old.stop()
        eng.stop()
    print(
        f"\n{args.streams} streams per gateway, {args.workers} worker(s) each, "
        f"{args.max_tokens}-token completions, {args.duration:g} s per pass; logs in {logs}"
    )
    print(table(["pass", "gateway", "CPU us/chunk", "chunks", "failed", "new / old"], rows))
    print(f"median new / old: {median(ratios):.2f}x")


if __name__ == "__main__":
    asyncio.run(main())
