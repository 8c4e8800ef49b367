"""What a gateway adds: direct-to-engine versus through a gateway, same engine, same run.

Targets, all in front of one simulated engine (128-token completions, 20 ms per decode
step, no per-sequence slowdown, room for every stream):

- direct: the load client straight to the engine (the baseline);
- unbroken, 1 worker: `unbroken gateway --workers 1` (one process);
- unbroken, N workers: `unbroken gateway --workers N` (N = os.cpu_count(): a main process
  and N serving processes on one port);
- vllm-router: vLLM's Rust router from PyPI (`scripts/bench-peer.sh` installs it into its
  own cached venv), `--policy round_robin` (`--peer-policy`), as a peer. If it cannot be
  installed or started, its rows say why and the rest of the table still prints.

For each concurrency (64, 256 and 1024 streams, closed loop) the passes alternate between
the targets (`--repeats` each, the order reversed every other repeat) and the table reports
medians: TTFT p50/p99 and their ratio to direct, the added TTFT, the inter-token gaps, and
the gateway's CPU per relayed chunk: utime+stime of the gateway's processes (for N workers,
the main process and every worker; /proc) over the pass, divided by the tokens relayed (one
per chunk). Only the gateway's processes count: the engine and the load client share the
same cores and are not in it. And its memory per open stream: the proportional set size of
the gateway's processes (smaps_rollup: shared pages counted once) in the middle of the
measured window, less the same taken idle right after it started, divided by the streams.

    python benchmarks/gateway_overhead.py [--duration 8] [--repeats 2] [--no-peer]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).parent))

from _common import (
    Service,
    engine_service,
    gateway_service,
    install_peer,
    median,
    router_service,
    table,
    tree_cpu_seconds,
    tree_pss_bytes,
    wait_http,
)
from _lean_client import LeanRun
from unbroken.bench.load import LoadConfig, LoadRun
from unbroken.bench.stats import percentile

ROOT = Path(__file__).resolve().parent.parent
ITL_S = 0.020  # the engine's decode step, whatever the batch
SETTLE_S = 0.5  # after the ramp, before requests count for latency
PEER_POLICIES = ("round_robin", "cache_aware", "power_of_two", "random")


@dataclass
class Target:
    name: str
    url: str | None  # None: not running (see `why`)
    pid: int | None = None  # the gateway's (main) process; None for direct
    why: str = ""  # why it is not running
    log: str = ""
    idle_pss: int = 0  # its processes' PSS before any load


def bench_engine(streams: int, max_tokens: int) -> Service:
    """The one engine every target shares: room for `streams` at once, a fixed step."""
    return engine_service(
        "--max-num-seqs", str(max(512, 2 * streams)),
        "--kv-capacity-tokens", str(max(65_536, 4 * streams * (max_tokens + 16))),
        "--decode-base-s", str(ITL_S), "--decode-per-seq-s", "0",
    )  # fmt: skip


def pct(xs: list[float], p: float) -> float:
    v = percentile(xs, p)
    return float("nan") if v is None else v


def raise_fd_limit(want: int = 65536) -> None:
    """1024 streams hold ~4 fds each across client, gateway and engine (children inherit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


class PacedRun(LoadRun):
    """unbroken bench's load generator with its users started at fixed offsets over `ramp`.
    LoadRun paces its starts with one short wait per user, which a saturated event loop
    stretches (1024 users took ~25 s to start on 2 cores); here every user sleeps to its own
    offset, so the ramp keeps its length and the load is even, not in waves."""

    def __init__(self, cfg: LoadConfig, ramp: float) -> None:
        super().__init__(cfg)
        self.ramp = ramp

    async def _start_users(self, session: aiohttp.ClientSession) -> list[asyncio.Task[None]]:
        users = self.cfg.users

        async def user(i: int) -> None:
            await asyncio.sleep(i * self.ramp / users)
            if not self._stop.is_set():
                await self._user(session, i)

        return [asyncio.create_task(user(i)) for i in range(users)]


async def closed_loop(
    url: str,
    users: int,
    duration: float,
    max_tokens: int,
    ramp: float,
    warmup: float,
    client: str = "lean",
) -> LoadRun | LeanRun:
    """`users` clients streaming completions back to back, starting evenly over `ramp` (one
    request's length). `lean` (the default): `_lean_client.py`, which costs a few us per
    token; `bench`: `unbroken bench`'s load generator with text verification off, which
    costs several times that and at 1,024 streams takes a core from the engine and the
    gateway."""
    if client == "lean":
        lean = LeanRun(url, users, warmup + duration, max_tokens, ramp, model="unbroken-sim")
        await lean.run()
        return lean
    cfg = LoadConfig(
        url=url,
        users=users,
        duration=warmup + duration,
        prompt_words=(3, 3),
        max_tokens=(max_tokens, max_tokens),
        chat_fraction=0.0,
        verify=False,
    )
    run = PacedRun(cfg, ramp)
    await run.run()
    return run


async def start_peer(
    exe: str, engine_url: str, logs: Path, policy: str
) -> tuple[Service | None, str]:
    svc = router_service(exe, [engine_url], policy).start(logs, "vllm-router")
    assert svc.proc is not None
    deadline = time.monotonic() + 60
    while svc.proc.poll() is None and time.monotonic() < deadline:
        try:
            await wait_http(svc.url + "/health", timeout=1)
            return svc, ""
        except Exception:  # not up yet (any failure ends as a row that says why)
            pass
    code = svc.proc.poll()
    svc.stop()
    how = f"exited {code}" if code is not None else "no /health after 60 s"
    return None, f"vllm-router did not start: {how}, see {logs / 'vllm-router.log'}"


def router_version(exe: str) -> str:
    py = Path(exe).parent / "python"
    try:
        return subprocess.run(
            [str(py), "-c", "import importlib.metadata as m; print(m.version('vllm-router'))"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "?"


async def measure(
    t: Target, users: int, args: argparse.Namespace, engine_pid: int
) -> dict[str, float]:
    ramp = args.max_tokens * ITL_S
    warmup = ramp + SETTLE_S
    assert t.url is not None
    c0 = tree_cpu_seconds(t.pid) if t.pid else 0.0
    e0, l0, w0 = tree_cpu_seconds(engine_pid), time.process_time(), time.monotonic()
    pss: list[int] = []

    async def sample() -> None:  # mid-window: every stream open, none ending
        await asyncio.sleep(warmup + args.duration / 2)
        if t.pid:
            pss.append(tree_pss_bytes(t.pid))

    sampler = asyncio.create_task(sample())
    run = await closed_loop(
        t.url, users, args.duration, args.max_tokens, ramp, warmup, client=args.client
    )
    await sampler
    cpu = (tree_cpu_seconds(t.pid) - c0) if t.pid else float("nan")
    wall = time.monotonic() - w0
    engine_cores = (tree_cpu_seconds(engine_pid) - e0) / wall
    client_cores = (time.process_time() - l0) / wall
    measured = [r for r in run.records if r.start >= warmup]
    ttfts = [r.ttft for r in measured if r.outcome == "ok" and r.ttft]
    gaps = [g for r in measured for g in r.gaps]
    chunks = sum(r.tokens for r in run.records)  # all of them: the CPU covers all
    out = {
        "p50": pct(ttfts, 50),
        "p99": pct(ttfts, 99),
        "itl": pct(gaps, 50),
        "itl99": pct(gaps, 99),
        "cpu_per_chunk": cpu / chunks if chunks else float("nan"),
        "cpu_share": cpu / wall,
        "chunks": chunks,
        "failed": sum(r.outcome != "ok" for r in run.records),
        "mem_per_stream": (pss[0] - t.idle_pss) / users if pss and t.idle_pss else float("nan"),
    }
    fails = Counter(
        f"{r.outcome}: {(r.detail or '?')[:60]}" for r in run.records if r.outcome != "ok"
    )
    print(
        f"  {users:>5} streams {t.name:<22} ttft p50 {out['p50'] * 1e3:8.2f} ms"
        f"  p99 {out['p99'] * 1e3:8.2f} ms  itl p50 {out['itl'] * 1e3:6.2f} ms"
        f"  chunks {chunks:>7}  cpu {out['cpu_per_chunk'] * 1e6:6.1f} us/chunk"
        f"  failed {out['failed']}  mem {out['mem_per_stream'] / 1024:6.1f} KiB/stream"
        f"  cores: gw {out['cpu_share']:.2f}"
        f" engine {engine_cores:.2f} client {client_cores:.2f}  {wall:.0f} s",
        file=sys.stderr,
    )
    for why, n in fails.most_common(3):
        print(f"        {n} x {why}", file=sys.stderr)
    return out


def rows_for(
    users: int, targets: list[Target], res: dict[str, list[dict[str, float]]], first: bool
) -> list[list[str]]:
    def med(name: str) -> dict[str, float]:
        return {k: median([r[k] for r in res[name]]) for k in res[name][0]}

    d = med("direct")
    peer = next((t for t in targets if t.name.startswith("vllm-router")), None)
    pc = med(peer.name)["cpu_per_chunk"] if peer and res.get(peer.name) else float("nan")
    rows = []
    for t in targets:
        if not res.get(t.name):
            why = f"not run: {t.why}" if first else "not run (see above)"
            rows.append([str(users), t.name, why] + [""] * 10)
            continue
        g = med(t.name)
        direct = t.name == "direct"
        if not g["chunks"] or g["p50"] != g["p50"]:
            why = f"no successful stream: {int(g['failed'])} failed, see {t.log}"
            rows.append([str(users), t.name, why] + [""] * 9 + [f"0 / {int(g['failed'])}"])
            continue
        cpu = g["cpu_per_chunk"] * 1e6
        rows.append(
            [
                str(users),
                t.name,
                f"{g['p50'] * 1e3:.2f}",
                f"{g['p50'] / d['p50']:.2f}x",
                "" if direct else f"{(g['p50'] - d['p50']) * 1e3:+.2f}",
                f"{g['p99'] * 1e3:.2f}",
                f"{g['p99'] / d['p99']:.2f}x",
                "" if direct else f"{(g['p99'] - d['p99']) * 1e3:+.2f}",
                f"{g['itl'] * 1e3:.2f} / {g['itl99'] * 1e3:.2f}",
                "-" if direct else f"{cpu:.1f}",
                "-" if direct or pc != pc else f"{g['cpu_per_chunk'] / pc:.2f}x",
                "-"
                if g["mem_per_stream"] != g["mem_per_stream"]
                else f"{g['mem_per_stream'] / 1024:.1f}",
                f"{int(g['chunks'])} / {int(g['failed'])}",
            ]
        )
    return rows


async def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--duration", type=float, default=8.0, help="measured seconds per pass")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument(
        "--workers", type=int, default=max(2, os.cpu_count() or 1), help="N [os.cpu_count()]"
    )
    ap.add_argument("--no-peer", action="store_true", help="skip vllm-router")
    ap.add_argument(
        "--baseline",
        metavar="SRC",
        help="also run a 1-worker gateway from another source tree (its src/ directory, "
        "e.g. `git worktree add /tmp/base HEAD~1` then /tmp/base/src), as 'baseline 1 "
        "worker': before and after a change in the same run",
    )
    ap.add_argument(
        "--client",
        choices=("lean", "bench"),
        default="lean",
        help="load client: lean (benchmarks/_lean_client.py) or unbroken bench's",
    )
    ap.add_argument(
        "--peer-policy",
        choices=PEER_POLICIES,
        default="round_robin",
        help="vllm-router's --policy (its own default is cache_aware)",
    )
    args = ap.parse_args()
    raise_fd_limit()
    t_start = time.monotonic()
    load0 = os.getloadavg()

    logs = Path(tempfile.mkdtemp(prefix="ub-bench-"))
    peer_exe, peer_why = (None, "--no-peer") if args.no_peer else install_peer()
    top = max(args.concurrency)
    eng = bench_engine(top, args.max_tokens).start(logs, "engine")
    cap = ("--cap", str(4 * top))
    gw1, _ = gateway_service(eng.url, args=cap)
    gwn, _ = gateway_service(eng.url, args=(*cap, "--workers", str(args.workers)))
    env = {"UNBROKEN_ADMIN_TOKEN": "bench"}
    gw1.start(logs, "gateway-1", env=env)
    gwb: Service | None = None
    if args.baseline:
        gwb, _ = gateway_service(eng.url, args=cap)
        gwb.start(logs, "gateway-baseline", env={**env, "PYTHONPATH": args.baseline})
    gwn.start(logs, f"gateway-{args.workers}", env=env)
    peer: Service | None = None
    try:
        await wait_http(eng.url + "/health")
        await wait_http(gw1.url + "/health")
        await wait_http(gwn.url + "/health")
        if gwb is not None:
            await wait_http(gwb.url + "/health")
        if peer_exe:
            peer, peer_why = await start_peer(peer_exe, eng.url, logs, args.peer_policy)
        await asyncio.sleep(2.5)  # the gateways' warm-up completions, endpoints ready
        assert eng.proc and gw1.proc and gwn.proc
        peer_name = "vllm-router " + (router_version(peer_exe) if peer_exe else "")
        targets = [
            Target("direct", eng.url),
            Target("unbroken 1 worker", gw1.url, gw1.proc.pid, log=f"{logs}/gateway-1.log"),
            Target(
                f"unbroken {args.workers} workers",
                gwn.url,
                gwn.proc.pid,
                log=f"{logs}/gateway-{args.workers}.log",
            ),
            Target(
                peer_name.strip(),
                peer.url if peer else None,
                peer.proc.pid if peer and peer.proc else None,
                peer_why,
                log=f"{logs}/vllm-router.log",
            ),
        ]
        if gwb is not None and gwb.proc:
            targets.insert(
                2,
                Target(
                    "baseline 1 worker",
                    gwb.url,
                    gwb.proc.pid,
                    log=f"{logs}/gateway-baseline.log",
                ),
            )
        live = [t for t in targets if t.url]
        for t in live:
            t.idle_pss = tree_pss_bytes(t.pid) if t.pid else 0
        rows = []
        for users in args.concurrency:
            res: dict[str, list[dict[str, float]]] = {t.name: [] for t in live}
            for i in range(args.repeats):
                for t in live if i % 2 == 0 else live[::-1]:
                    res[t.name].append(await measure(t, users, args, eng.proc.pid))
            rows += rows_for(users, targets, res, first=not rows)
        la = os.getloadavg()
        print(
            f"\nmachine: {platform.node()} {platform.machine()}, "
            f"{len(os.sched_getaffinity(0))} cpus, load average {load0[0]:.2f} at the start, "
            f"{la[0]:.2f} at the end; engine: {args.max_tokens}-token completions, "
            f"{ITL_S * 1e3:g} ms per step; {args.duration:g} s measured per pass "
            f"(after a {args.max_tokens * ITL_S + SETTLE_S:g} s ramp), "
            f"{args.repeats} pass(es) per target, medians; "
            f"vllm-router --policy {args.peer_policy}; {time.monotonic() - t_start:.0f} s in all; "
            f"logs in {logs}"
        )
        if peer:
            print(
                "vllm-router: " + " ".join(Path(a).name if a == peer_exe else a for a in peer.argv)
            )
        print(
            table(
                [
                    "streams",
                    "target",
                    "TTFT p50 ms",
                    "p50 vs direct",
                    "added p50 ms",
                    "TTFT p99 ms",
                    "p99 vs direct",
                    "added p99 ms",
                    "ITL p50 / p99 ms",
                    "gw CPU us/chunk",
                    "CPU vs vllm-router",
                    "gw KiB/stream",
                    "chunks / failed",
                ],
                rows,
            )
        )
    finally:
        if peer:
            peer.stop()
        gw1.stop()
        gwn.stop()
        if gwb is not None:
            gwb.stop()
        eng.stop()


if __name__ == "__main__":
    asyncio.run(main())
