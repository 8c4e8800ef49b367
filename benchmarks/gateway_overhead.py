"""What the gateway adds: direct-to-engine versus through the gateway, same engine, same run.

For each concurrency (64 and 256 streams, closed loop), runs alternate direct and gateway
passes (`--repeats` each) and reports medians: added TTFT p50/p99, the inter-token delta, and
the gateway's CPU per 1,000 relayed chunks (from /proc, utime+stime).

    python benchmarks/gateway_overhead.py [--duration 8] [--repeats 2]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _common import (
    closed_loop,
    cpu_seconds,
    engine_service,
    gateway_service,
    median,
    pct,
    table,
    wait_http,
)

BODY = {
    "model": "unbroken-sim",
    "prompt": "Benchmark the gateway",
    "max_tokens": 64,
    "temperature": 0,
    "stream": True,
}


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    BODY["max_tokens"] = args.max_tokens

    logs = Path(tempfile.mkdtemp(prefix="ub-bench-"))
    eng = engine_service("--max-num-seqs", "512").start(logs, "engine")
    gw, _ = gateway_service(eng.url, args=("--cap", "1024"))
    gw.start(logs, "gateway", env={"UNBROKEN_ADMIN_TOKEN": "bench"})
    try:
        await wait_http(eng.url + "/health")
        await wait_http(gw.url + "/health")
        await asyncio.sleep(2.5)  # warm-up completion passes, endpoint ready
        rows = []
        for users in args.concurrency:
            res: dict[str, list[dict[str, float]]] = {"direct": [], "gateway": []}
            for _ in range(args.repeats):
                for mode, url in (("direct", eng.url), ("gateway", gw.url)):
                    assert gw.proc is not None
                    c0 = cpu_seconds(gw.proc.pid)
                    samples = await closed_loop(url, users, args.duration, BODY)
                    cpu = cpu_seconds(gw.proc.pid) - c0
                    measured = [s for s in samples if not s.warmup]
                    ttfts = [s.ttft for s in measured if s.ok]
                    gaps = [g for s in measured for g in s.gaps]
                    chunks = sum(s.tokens for s in samples)  # all of them: CPU covers all
                    res[mode].append(
                        {
                            "p50": pct(ttfts, 50),
                            "p99": pct(ttfts, 99),
                            "itl": pct(gaps, 50),
                            "itl99": pct(gaps, 99),
                            "cpu_per_chunk": cpu / max(chunks, 1),
                            "chunks": chunks,
                            "failed": sum(not s.ok for s in samples),
                        }
                    )
                    last = res[mode][-1]
                    print(
                        f"  {users:>4} users {mode:<8} ttft p50 {last['p50'] * 1e3:7.2f} ms"
                        f"  p99 {last['p99'] * 1e3:7.2f} ms  chunks {chunks}",
                        file=sys.stderr,
                    )
            d = {k: median([r[k] for r in res["direct"]]) for k in res["direct"][0]}
            g = {k: median([r[k] for r in res["gateway"]]) for k in res["gateway"][0]}
            rows.append(
                [
                    str(users),
                    f"{d['p50'] * 1e3:.2f} / {g['p50'] * 1e3:.2f}",
                    f"{(g['p50'] - d['p50']) * 1e3:+.2f}",
                    f"{d['p99'] * 1e3:.2f} / {g['p99'] * 1e3:.2f}",
                    f"{(g['p99'] - d['p99']) * 1e3:+.2f}",
                    f"{(g['itl'] - d['itl']) * 1e3:+.2f} / {(g['itl99'] - d['itl99']) * 1e3:+.2f}",
                    f"{g['cpu_per_chunk'] * 1e6:.1f}",
                    f"{g['p50'] / d['p50']:.2f}x",
                    f"{int(g['chunks'])}",
                    f"{int(d['failed'] + g['failed'])}",
                ]
            )
        print(
            f"\nmachine: {platform.node()} {platform.machine()}, "
            f"{len(__import__('os').sched_getaffinity(0))} cpus; engine fp16 profile; "
            f"{args.duration:g} s per pass, {args.repeats} pass(es) each, medians"
        )
        print(
            table(
                [
                    "streams",
                    "TTFT p50 direct/gw ms",
                    "added p50 ms",
                    "TTFT p99 direct/gw ms",
                    "added p99 ms",
                    "ITL delta p50/p99 ms",
                    "gw CPU us/chunk",
                    "p50 ratio",
                    "chunks (gw)",
                    "failed",
                ],
                rows,
            )
        )
    finally:
        gw.stop()
        eng.stop()


if __name__ == "__main__":
    asyncio.run(main())
