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
    cpu_seconds,
    engine_service,
    gateway_service,
    median,
    table,
    wait_http,
)
from unbroken.bench.load import LoadConfig, LoadRun
from unbroken.bench.stats import percentile

WARMUP_S = 1.5  # requests started earlier count for CPU per chunk, not for latency


def pct(xs: list[float], p: float) -> float:
    v = percentile(xs, p)
    return float("nan") if v is None else v


async def closed_loop(url: str, users: int, duration: float, max_tokens: int) -> LoadRun:
    """`users` clients streaming completions back to back (unbroken bench's load
    generator, text verification off to keep the client light)."""
    cfg = LoadConfig(
        url=url,
        users=users,
        spawn_rate=users / 1.0,
        duration=WARMUP_S + duration,
        prompt_words=(3, 3),
        max_tokens=(max_tokens, max_tokens),
        chat_fraction=0.0,
        verify=False,
    )
    run = LoadRun(cfg)
    await run.run()
    return run


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()

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
                    run = await closed_loop(url, users, args.duration, args.max_tokens)
                    cpu = cpu_seconds(gw.proc.pid) - c0
                    measured = [r for r in run.records if r.start >= WARMUP_S]
                    ttfts = [r.ttft for r in measured if r.outcome == "ok" and r.ttft]
                    gaps = [g for r in measured for g in r.gaps]
                    chunks = sum(r.tokens for r in run.records)  # all of them: CPU covers all
                    res[mode].append(
                        {
                            "p50": pct(ttfts, 50),
                            "p99": pct(ttfts, 99),
                            "itl": pct(gaps, 50),
                            "itl99": pct(gaps, 99),
                            "cpu_per_chunk": cpu / max(chunks, 1),
                            "chunks": chunks,
                            "failed": sum(r.outcome != "ok" for r in run.records),
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
