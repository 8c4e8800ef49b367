"""A load step against an autoscaled pool, and against the same pool fixed at its `min`, in
the same run: `--low` streaming users, then `--high` for `--hold` seconds, then `--low` again
until the pool has shrunk back.

    python benchmarks/autoscale.py [--low 40] [--high 200] [--hold 30] [--target 50]

Each pass runs `unbroken up` (simulated engines, the controller's autoscaler) with one pool
`replicas: {min: 1, max: --max}` (`cap` = `--target` streams per replica), or fixed at 1. It
reports, per pass: the TTFT p99 before the step, its peak after, the time from the step (and
from the scale-up decision) until the rolling TTFT p99 is back under `--ttft-target-ms` for
good, the decision's delay after the signal crossed its target (the gateway's
`unbroken_gateway_pool_demand` read every 100 ms here), the replicas over time, and streams
dropped or corrupted (every text checked against the simulator's; the scale-downs included).
A plot of replicas and TTFT p99 over time goes to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import aiohttp

from _common import UpPipeline, table
from unbroken.bench.load import LoadConfig, LoadRun, Record
from unbroken.bench.stats import percentile
from unbroken.controller.scaling import parse_demand


def spec(args: argparse.Namespace, autoscaled: bool) -> str:
    replicas = f"{{min: 1, max: {args.max}}}" if autoscaled else "1"
    return f"""
pools:
  - name: primary
    replicas: {replicas}
    cap: {args.target}
    scaling: {{target: {args.target}, interval_s: 0.25, up_cooldown_s: 1,
               down_quiet_s: {args.quiet}, down_cooldown_s: 2, drain_deadline_s: 2}}
    weights_size: 16MiB
    engine: {{profile: fp16, overrides: {{decode_base_s: 0.02, decode_per_seq_s: 0.00005}}}}
gateway: {{queue_timeout_s: 120, max_queue: 4096}}
controller: {{convert_after_s: null, min_full_replicas: 0}}
"""


class Pipeline(UpPipeline):
    async def pools(self) -> dict[str, Any]:
        conn = aiohttp.UnixConnector(path=str(self.state / "supervisor.sock"))
        async with (
            aiohttp.ClientSession(connector=conn) as s,
            s.get("http://supervisor/pools") as r,
        ):
            data: dict[str, Any] = await r.json()
            return data

    async def decisions(self) -> list[dict[str, Any]]:
        async with (
            aiohttp.ClientSession() as s,
            s.get(f"http://127.0.0.1:{self.ctl_port}/decisions") as r,
        ):
            return list((await r.json())["decisions"])


async def watch(p: Pipeline, t0: float, out: list[tuple[float, int, float]], stop: asyncio.Event):
    """(t, live replicas, demand) every 100 ms."""
    async with aiohttp.ClientSession() as s:
        while not stop.is_set():
            try:
                pools = await p.pools()
                async with s.get(p.url + "/metrics") as r:
                    demand = parse_demand(await r.text()).get("primary", 0.0)
                live = next(q["live"] for q in pools["pools"] if q["name"] == "primary")
                out.append((time.monotonic() - t0, int(live), demand))
            except (aiohttp.ClientError, OSError, StopIteration):
                pass
            await asyncio.sleep(0.1)


def windows(
    records: list[Record], width: float = 2.0, step: float = 1.0
) -> list[tuple[float, float]]:
    """(window start, TTFT p99 of the requests started in [t, t+width)) every `step` s."""
    done = [(r.start, r.ttft) for r in records if r.ttft is not None]
    if not done:
        return []
    end = max(s for s, _ in done)
    out, t = [], 0.0
    while t <= end:
        xs = [ttft for s, ttft in done if t <= s < t + width]
        if xs:
            out.append((t, percentile(xs, 99)))
        t += step
    return out


async def one(args: argparse.Namespace, tmp: Path, autoscaled: bool) -> dict[str, Any]:
    name = "autoscaled" if autoscaled else "fixed"
    p = Pipeline(tmp, spec(args, autoscaled), name)
    try:
        await p.wait()
        await asyncio.sleep(1.0)
        total = args.before + args.hold + args.after
        base = LoadRun(LoadConfig(url=p.url + "/v1", users=args.low, spawn_rate=0,
                                  duration=total, max_tokens=(64, 160), seed=1))  # fmt: skip
        burst = LoadRun(LoadConfig(url=p.url + "/v1", users=args.high - args.low, spawn_rate=0,
                                   duration=args.hold, max_tokens=(64, 160), seed=2))  # fmt: skip
        timeline: list[tuple[float, int, float]] = []
        stop = asyncio.Event()
        t0 = time.monotonic()
        watcher = asyncio.create_task(watch(p, t0, timeline, stop))

        async def later() -> list[Record]:
            await asyncio.sleep(args.before)
            return await burst.run()

        print(f"  {name}: {args.low} users, {args.high} at {args.before:g} s for {args.hold:g} s")
        a, b = await asyncio.gather(base.run(), later())
        stop.set()
        await watcher
        decisions = [d for d in await p.decisions() if d["action"].startswith("scale")]
    finally:
        p.stop()
    # The two runs' clocks: base started at t0, the burst `before` s later (its own t0).
    recs = list(a) + [_shift(r, args.before) for r in b]
    ws = windows(recs)
    pre = [v for t, v in ws if t + 2.0 <= args.before]
    post = [(t, v) for t, v in ws if args.before <= t < args.before + args.hold]
    target = args.ttft_target_ms / 1e3
    bad_until = max((t + 2.0 for t, v in post if v > target), default=args.before)
    recovered = bad_until - args.before if post and any(v <= target for _, v in post) else None
    if post and bad_until >= args.before + args.hold - 2.0:
        recovered = None  # never back under target while the burst lasted
    wall0 = time.time() - (time.monotonic() - t0)
    ups = [d for d in decisions if d["action"].startswith("scale up to")]
    first_up = (ups[0]["t"] - wall0) if ups else None
    crossed = next(
        (t for t, live, dem in timeline if t >= args.before and dem > live * args.target * 1.1),
        None,
    )
    outcomes: dict[str, int] = {}
    for r in recs:
        outcomes[r.outcome] = outcomes.get(r.outcome, 0) + 1
    return {
        "name": name,
        "ttft_p99_before_ms": 1e3 * (max(pre) if pre else float("nan")),
        "ttft_p99_peak_ms": 1e3 * max((v for _, v in post), default=float("nan")),
        "recovered_after_step_s": recovered,
        "recovered_after_decision_s": (
            None if recovered is None or first_up is None else args.before + recovered - first_up
        ),
        "decision_after_signal_s": (
            None if first_up is None or crossed is None else first_up - crossed
        ),
        "max_replicas": max((live for _, live, _ in timeline), default=0),
        "final_replicas": timeline[-1][1] if timeline else 0,
        "timeline": timeline,
        "windows": ws,
        "decisions": [(d["action"], round(d["t"] - wall0, 1)) for d in decisions],
        "outcomes": outcomes,
        "requests": len(recs),
    }


def _shift(r: Record, dt: float) -> Record:
    r.start += dt
    return r


def fmt(x: float | None, unit: str = "", digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}{unit}"


def plot(results: list[dict[str, Any]], out: Path, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for r in results:
        ax1.step([t for t, _, _ in r["timeline"]], [n for _, n, _ in r["timeline"]],
                 where="post", label=r["name"])  # fmt: skip
        ax2.plot([t for t, _ in r["windows"]], [v * 1e3 for _, v in r["windows"]], label=r["name"])
    for ax in (ax1, ax2):
        ax.axvspan(args.before, args.before + args.hold, color="0.9")
    ax2.axhline(args.ttft_target_ms, color="red", linestyle="--", label="target")
    ax1.set_ylabel("replicas")
    ax2.set_ylabel("TTFT p99 (ms, 2 s windows)")
    ax2.set_yscale("log")
    ax2.set_xlabel("seconds")
    ax1.legend()
    ax2.legend()
    fig.tight_layout()
    fig.savefig(out)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--low", type=int, default=40)
    ap.add_argument("--high", type=int, default=200)
    ap.add_argument("--before", type=float, default=15.0)
    ap.add_argument("--hold", type=float, default=30.0)
    ap.add_argument("--after", type=float, default=35.0)
    ap.add_argument("--target", type=int, default=50, help="streams per replica (and its cap)")
    ap.add_argument("--max", type=int, default=4)
    ap.add_argument("--quiet", type=float, default=10.0, help="down_quiet_s")
    ap.add_argument("--ttft-target-ms", type=float, default=500.0)
    ap.add_argument("--out", type=Path, default=Path("autoscale.png"))
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-autoscale-") as d:
        results = [await one(args, Path(d), True), await one(args, Path(d), False)]
    auto, fixed = results
    rows = []
    for r in results:
        bad = {k: v for k, v in r["outcomes"].items() if k != "ok"}
        rows.append([
            r["name"],
            fmt(r["ttft_p99_before_ms"], " ms", 0),
            fmt(r["ttft_p99_peak_ms"], " ms", 0),
            f"{r['ttft_p99_peak_ms'] / fixed['ttft_p99_peak_ms']:.2f}x",
            fmt(r["recovered_after_step_s"], " s"),
            fmt(r["recovered_after_decision_s"], " s"),
            fmt(r["decision_after_signal_s"], " s", 2),
            f"{r['max_replicas']} -> {r['final_replicas']}",
            str(r["requests"]),
            ", ".join(f"{k} {v}" for k, v in sorted(bad.items())) or "0",
        ])  # fmt: skip
    print()
    print(table(
        ["pool", "TTFT p99 before", "peak after step", "vs fixed", "under target after step",
         "after decision", "decision after signal", "replicas max -> end", "requests",
         "not ok"],
        rows,
    ))  # fmt: skip
    print(
        f"\nstep {args.low} -> {args.high} users at {args.before:g} s for {args.hold:g} s; "
        f"target {args.target} streams per replica, TTFT target {args.ttft_target_ms:g} ms; "
        f"autoscaler's decisions (action, s): {auto['decisions'][:10]}"
    )
    plot(results, args.out, args)
    print(f"plot: {args.out}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    asyncio.run(main())
