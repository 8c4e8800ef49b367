"""Routing on prefix-heavy workloads: unbroken's policies against vllm-router, same engines,
same run.

N simulated engines (vLLM-v1-style prefix cache: 16-token blocks, prefill paid only for the
tokens it does not hold; KV cache sized so that one engine cannot hold every workload's
working set but N together can), and in front of them, one after the other:

- `unbroken gateway --routing NAME` for NAME in latency (today's default), least_load,
  prefix, session (`--routers` picks; round_robin too);
- vllm-router (PyPI, installed by scripts/bench-peer.sh into its own cached venv) with
  `--policy round_robin` and `--policy cache_aware` (its defaults otherwise). When it cannot
  be installed or started, the run says why and goes on without it.

Each (workload, router) pass starts from cold: fresh engine processes (empty prefix caches)
and a fresh router. Workloads (bench/workloads.py, the same as `unbroken bench --workload`):
shared-prefix (inference-perf's generator), multi-turn (chat: conversations carrying their
history, replies ~3x the question, a session id per user), multi-turn-short (the same with
replies shorter than the questions: this table's multi-turn before 2026-12-03) and, on
request, agent (long tool outputs, short replies). Per pass: TTFT p50/p99 and ITL p50 of the
client's requests, the cluster's prefix-cache hit rate (the engines' vllm:prefix_cache_*
counters), busiest/least-busy engine by requests served, failures; and the TTFT ratios to
vllm-router cache_aware and round_robin (unbroken's round_robin where vllm-router's did not
run). One table per workload, and one of the TTFT's parts by the engines' own clocks (the
wait for the step then running, the step that prefilled the request, the prompt tokens it
had to prefill, the time outside the engine); `--json` saves everything.

    python benchmarks/routing.py [--duration S] [--users 25] [--engines 3] [--no-peer]
        [--routers latency,least_load,prefix,session,vllm-router:round_robin,...]
        [--workloads shared-prefix,multi-turn,multi-turn-short,agent] [--json PATH]
        [--gateway-workers 1] [--gateway-replicas 1]

`--gateway-workers N` runs each unbroken gateway with N worker processes (one port);
`--gateway-replicas N` runs N gateways side by side, user i on gateway i mod N (what a
Kubernetes Service in front of N gateway pods does with the clients' connections);
`--prefix-share` starts a redis-server for the run and gives the gateways its URL as
`prefix_share_url` (the replicas tell each other what they sent where).

Without the gateway's --routing flag (before issue 23's policies landed), the latency row runs
the gateway's default policy and any other gateway policy is refused with a message.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from _common import (
    Service,
    engine_service,
    gateway_service,
    install_peer,
    router_service,
    table,
    wait_http,
)
from unbroken.bench.load import LoadConfig, LoadRun, base_url
from unbroken.bench.stats import percentile
from unbroken.bench.workloads import EngineWatch, MultiTurn, SharedPrefix, WorkloadSpec
from unbroken.clients import GatewayAdmin
from unbroken.wire.http import free_port, wait_ok

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "bench"
GATEWAY_POLICIES = ("latency", "least_load", "round_robin", "prefix", "session")
PEER_POLICIES = ("round_robin", "cache_aware")
DEFAULT_ROUTERS = (
    "latency",
    "least_load",
    "prefix",
    "session",
    "vllm-router:round_robin",
    "vllm-router:cache_aware",
)

# Engines: the fp16 profile's prefill cost (40 us a token: a 1,000-token miss is 40 ms), a
# shorter decode step than its 20 ms so a pass fits in seconds, and a KV cache of 16,384
# tokens (1,024 blocks): less than either workload's working set below, more than a third
# of it.
ENGINE_ARGS = (
    "--max-num-seqs",
    "64",
    "--kv-capacity-tokens",
    "16384",
    "--prefill-per-token-s",
    "0.00004",
    "--decode-base-s",
    "0.010",
    "--decode-per-seq-s",
    "0.0002",
)
# 24 system prompts of 1,000 words (24,000 tokens of prefixes, plus 384 questions): more than
# one engine's cache, less than three.
#
# multi-turn: chat as people use it. Replies are about three times the question (LMSYS-Chat-1M,
# a million real conversations: ~70 tokens a user message, ~215 a reply), so most of what a
# turn carries is the assistant's earlier replies, which an engine that served them holds
# and one that did not must prefill. 25 conversations growing to 200 + 6 x 285 = 1,910 tokens
# (47,750 tokens of history): more than one engine's cache, less than three.
# multi-turn-short: this table's multi-turn until 2026-12-03 (questions of 100 words, replies
# of 50, 8 turns; 33,600 tokens of history): kept to compare, and because with replies that
# short the turn's own question is most of what any router must prefill.
# agent: an agent loop: a long system prompt (tool definitions), each turn a tool's output
# appended and a short reply (the next tool call); not in the default set.
WORKLOADS: dict[str, WorkloadSpec] = {
    "shared-prefix": SharedPrefix(
        num_groups=24,
        num_prompts_per_group=16,
        system_prompt_len=1000,
        question_len=50,
        output_len=50,
    ),
    "multi-turn": MultiTurn(num_turns=6, system_prompt_len=200, question_len=70, output_len=215),
    "multi-turn-short": MultiTurn(
        num_turns=8, system_prompt_len=200, question_len=100, output_len=50
    ),
    "agent": MultiTurn(num_turns=4, system_prompt_len=500, question_len=300, output_len=60),
}
DEFAULT_WORKLOADS = ("shared-prefix", "multi-turn", "multi-turn-short")
# Seconds of load per pass when --duration is not given: multi-turn's requests take ~2.5 s
# (215-word replies), so 20 s made ~200 of them and a p99 the second-slowest request (the
# p99 against cache_aware read 0.47x to 1.36x over a day's runs of unchanged routing); 60 s
# makes ~600. The others' requests take under a second: ~700-1,000 in 20 s.
DURATION_S: dict[str, float] = {"multi-turn": 60.0}
DEFAULT_DURATION_S = 20.0


def duration_of(workload: str, given: float | None) -> float:
    return given if given is not None else DURATION_S.get(workload, DEFAULT_DURATION_S)


@dataclass
class Pass:
    workload: str
    router: str
    ok: bool = False
    why: str = ""
    requests: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    ttft_p50: float | None = None
    ttft_p99: float | None = None
    ttft_mean: float | None = None  # TTFT is bimodal here (prefix hit or miss): p50 flips
    itl_p50: float | None = None
    hit_rate: float | None = None
    spread: float | None = None
    served: list[int] = field(default_factory=list)
    parts: dict[str, float] | None = None  # the engines' TTFT parts (EngineWatch.ttft_parts)
    failures: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


# -- the routers -----------------------------------------------------------------------------


def gateway_has_routing() -> bool:
    """Does `unbroken gateway` take --routing (issue 23)? Its --help says."""
    p = subprocess.run(
        [sys.executable, "-m", "unbroken", "gateway", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return "--routing" in p.stdout


def peer_version(exe: str) -> str:
    py = Path(exe).parent / "python"
    p = subprocess.run(
        [str(py), "-c", "import importlib.metadata as m; print(m.version('vllm-router'))"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    return p.stdout.strip() or "?"


async def until_serving(url: str, timeout: float = 60.0) -> None:
    """One tiny completion through the router succeeds (its workers are known and up)."""
    import aiohttp

    body = {"model": "unbroken-sim", "prompt": "warm", "max_tokens": 1}
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
        while True:
            try:
                async with s.post(url + "/v1/completions", json=body) as r:
                    if r.status == 200:
                        await r.read()
                        return
            except (aiohttp.ClientError, TimeoutError, OSError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} served no completion in {timeout:.0f} s")
            await asyncio.sleep(0.2)


async def healthy(svc: Service, log: Path, timeout: float = 60.0) -> None:
    """/health answers 200; a process that exits first is an error with its last words (a
    gateway that refuses --routing NAME says so in its log)."""
    import aiohttp

    def alive() -> None:
        assert svc.proc is not None
        if svc.proc.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-3:]
            raise RuntimeError(f"exited {svc.proc.returncode}: {' | '.join(tail)}")

    async with aiohttp.ClientSession() as s:
        await wait_ok(s, svc.url + "/health", timeout=timeout, interval=0.1, check=alive)


async def start_router(
    router: str, urls: list[str], logs: Path, args: argparse.Namespace, peer: str | None
) -> list[Service]:
    """The router in front of `urls`, serving (`--gateway-replicas` gateways for unbroken's
    rows); stopped again if it does not get there."""
    started: list[Service] = []
    try:
        n = 1 if router.startswith("vllm-router:") else args.gateway_replicas
        for i in range(n):
            name = router if n == 1 else f"{router}-replica{i}"
            await _start_router(router, urls, logs, args, peer, started, name)
        return started
    except BaseException:
        for s in started:
            s.stop()
        raise


_REPLICA: ContextVar[int] = ContextVar("replica", default=0)


class SpreadRun(LoadRun):
    """The load over several gateway replicas, each user on one of them (user i on replica
    i mod N), as a Kubernetes Service spreads clients' connections over a Deployment's pods:
    no replica sees every request of a system prompt."""

    def __init__(self, cfg: LoadConfig, urls: list[str]) -> None:
        self._urls = [base_url(u) for u in urls]
        super().__init__(cfg)

    @property  # type: ignore[override]
    def base(self) -> str:
        return self._urls[_REPLICA.get()]

    @base.setter
    def base(self, _url: str) -> None:
        pass  # LoadRun sets one; the user's task picks its own

    async def _user(self, session: Any, user: int) -> None:
        _REPLICA.set(user % len(self._urls))  # this user's task only
        await super()._user(session, user)


async def _start_router(
    router: str,
    urls: list[str],
    logs: Path,
    args: argparse.Namespace,
    peer: str | None,
    started: list[Service],
    name: str,
) -> Service:
    name = name.replace(":", "-")
    if router.startswith("vllm-router:"):
        assert peer is not None
        svc = router_service(peer, urls, router.split(":", 1)[1]).start(logs, name)
        started.append(svc)
        await healthy(svc, logs / f"{name}.log")
        await until_serving(svc.url)
        return svc
    extra = ("--workers", str(args.gateway_workers))
    if args.share_config is not None:
        extra += ("--config", str(args.share_config))
    if args.routing_flag:
        extra += ("--routing", router)
    svc, admin = gateway_service(*urls, args=extra)
    svc.start(logs, name, env={"UNBROKEN_ADMIN_TOKEN": TOKEN})
    started.append(svc)
    await healthy(svc, logs / f"{name}.log")
    async with GatewayAdmin(f"http://127.0.0.1:{admin}", TOKEN) as gw:
        deadline = time.monotonic() + 60
        while sum(e["state"] == "ready" for e in await gw.endpoints()) < len(urls):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{router}: not every endpoint ready after 60 s")
            await asyncio.sleep(0.1)
    return svc


# -- one pass --------------------------------------------------------------------------------


def pct_ms(xs: list[float], p: float) -> float | None:
    v = percentile(xs, p)
    return None if v is None else v * 1e3


async def one_pass(
    workload: str, router: str, args: argparse.Namespace, logs: Path, peer: str | None
) -> Pass:
    res = Pass(workload, router)
    t0 = time.monotonic()
    tag = f"{workload}-{router.replace(':', '-')}"
    engines = [
        engine_service(*ENGINE_ARGS).start(logs / tag, f"engine-{i}") for i in range(args.engines)
    ]
    svcs: list[Service] = []
    try:
        for e in engines:
            await wait_http(e.url + "/health")
        urls = [e.url for e in engines]
        try:
            svcs = await start_router(router, urls, logs / tag, args, peer)
        except (TimeoutError, OSError, RuntimeError) as e:
            res.why = f"did not start: {e} (logs: {logs / tag})"
            return res
        spec = WORKLOADS[workload]
        cfg = LoadConfig(
            url=svcs[0].url,
            users=args.users,
            spawn_rate=args.users / args.ramp if args.ramp > 0 else 0,
            duration=duration_of(workload, args.duration),
            workload=spec,
            seed=args.seed,
        )
        watch = EngineWatch(urls)
        await watch.start()
        run = LoadRun(cfg) if len(svcs) == 1 else SpreadRun(cfg, [s.url for s in svcs])
        await run.run()
        eng = await watch.stop()
        recs = run.records
        ok = [r for r in recs if r.outcome == "ok"]
        res.ok = True
        res.requests = len(recs)
        res.outcomes = dict(Counter(r.outcome for r in recs))
        res.failures = dict(
            Counter(f"{r.outcome}: {(r.detail or '?')[:60]}" for r in recs if r.outcome != "ok")
        )
        res.ttft_p50 = pct_ms([r.ttft for r in ok if r.ttft is not None], 50)
        ttfts = [r.ttft for r in ok if r.ttft is not None]
        res.ttft_p99 = pct_ms(ttfts, 99)
        res.ttft_mean = sum(ttfts) / len(ttfts) * 1e3 if ttfts else None
        res.itl_p50 = pct_ms([g for r in ok for g in r.gaps], 50)
        res.hit_rate = eng["hit_rate"]
        res.spread = eng["spread"]
        res.parts = eng["ttft_parts"]
        res.served = [e.get("requests", 0) for e in eng["engines"].values()]
        return res
    finally:
        res.seconds = time.monotonic() - t0
        for s in svcs:
            s.stop()
        for e in engines:
            e.stop()
        print(f"  {workload:<14} {router:<24} {summary(res)}", file=sys.stderr)


def summary(p: Pass) -> str:
    if not p.ok:
        return f"not run: {p.why}"
    return (
        f"{p.requests} requests, TTFT p50 {fmt(p.ttft_p50)} p99 {fmt(p.ttft_p99)} "
        f"mean {fmt(p.ttft_mean)} ms, "
        f"ITL p50 {fmt(p.itl_p50)} ms, hit rate {pct(p.hit_rate)}, served {p.served}, "
        f"failed {p.requests - p.outcomes.get('ok', 0)}, {p.seconds:.0f} s"
        + "".join(f"\n      {n} x {why}" for why, n in sorted(p.failures.items()))
    )


# -- the tables ------------------------------------------------------------------------------


def fmt(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1%}"


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def workload_table(passes: list[Pass]) -> str:
    by = {p.router: p for p in passes if p.ok}
    # Round robin: vllm-router's, or unbroken's where vllm-router's did not run.
    ca = by.get("vllm-router:cache_aware")
    rr = by.get("vllm-router:round_robin") or by.get("round_robin")
    rows = []
    for p in passes:
        if not p.ok:
            rows.append([p.router, f"not run: {p.why}"] + [""] * 13)
            continue
        failed = p.requests - p.outcomes.get("ok", 0)
        spread = "-" if p.spread is None else f"{p.spread:.2f}x"
        rows.append(
            [
                p.router,
                str(p.requests),
                fmt(p.ttft_p50),
                fmt(p.ttft_p99),
                fmt(p.ttft_mean),
                fmt(p.itl_p50),
                pct(p.hit_rate),
                spread,
                str(failed),
                ratio(p.ttft_p50, ca.ttft_p50 if ca else None),
                ratio(p.ttft_p99, ca.ttft_p99 if ca else None),
                ratio(p.ttft_mean, ca.ttft_mean if ca else None),
                ratio(p.ttft_p50, rr.ttft_p50 if rr else None),
                ratio(p.ttft_p99, rr.ttft_p99 if rr else None),
                ratio(p.ttft_mean, rr.ttft_mean if rr else None),
            ]
        )
    headers = [
        "router",
        "requests",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "TTFT mean ms",
        "ITL p50 ms",
        "hit rate",
        "busiest/least",
        "errors",
        "p50 vs cache_aware",
        "p99 vs cache_aware",
        "mean vs cache_aware",
        "p50 vs round_robin",
        "p99 vs round_robin",
        "mean vs round_robin",
    ]
    return table(headers, rows)


def parts_table(passes: list[Pass]) -> str:
    """Where a first token's time goes, by the engines' own clocks (means, ms): waiting for
    the step then running, the step that prefilled it, and the client's TTFT less the
    engine's (router, network, the client)."""
    rows = []
    for p in passes:
        if not p.ok or p.parts is None:
            continue
        q = p.parts
        rows.append(
            [
                p.router,
                fmt(p.ttft_mean),
                fmt(q["ttft_ms"]),
                fmt(q["queue_ms"]),
                fmt(q["prefill_ms"]),
                fmt(q["step_ms"]),
                fmt(q["prompt"], 0),
                fmt(q["uncached"], 0),
                fmt(None if p.ttft_mean is None else p.ttft_mean - q["ttft_ms"]),
                str(round(q.get("preemptions", 0))),
            ]
        )
    headers = [
        "router",
        "client TTFT",
        "engine TTFT",
        "queue (wait for the step)",
        "prefill step",
        "decode step (ITL)",
        "prompt tokens",
        "uncached tokens",
        "outside the engine",
        "preemptions",
    ]
    return table(headers, rows)


def parse_routers(text: str) -> list[str]:
    routers = [r.strip() for r in text.split(",") if r.strip()]
    for r in routers:
        ok = r in GATEWAY_POLICIES or (
            r.startswith("vllm-router:") and r.split(":", 1)[1] in PEER_POLICIES
        )
        if not ok:
            known = ", ".join([*GATEWAY_POLICIES] + [f"vllm-router:{p}" for p in PEER_POLICIES])
            raise SystemExit(f"routing.py: unknown router {r!r} (known: {known})")
    return routers


def _start_redis(logs: Path) -> tuple[subprocess.Popen[bytes], Path]:
    """`--prefix-share`: a redis-server for the run, and the gateways' config naming it."""
    port = free_port()
    redis = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", str(logs)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    config = logs / "share.yaml"
    config.write_text(f"prefix_share_url: redis://127.0.0.1:{port}/0\n")
    return redis, config


async def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--duration",
        type=float,
        default=None,
        help="seconds of load per pass (default: 60 for multi-turn, 20 for the others)",
    )
    ap.add_argument("--ramp", type=float, default=2.0, help="seconds to start the users")
    ap.add_argument(
        "--users",
        type=int,
        default=25,
        help="closed-loop streaming users (prime to --engines: with 24 users on 3 engines the "
        "users fall into step and round robin keeps each conversation where it was)",
    )
    ap.add_argument("--engines", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1, help="the workloads' seed")
    ap.add_argument("--routers", default=",".join(DEFAULT_ROUTERS))
    ap.add_argument(
        "--workloads",
        default=",".join(DEFAULT_WORKLOADS),
        help=f"of {', '.join(WORKLOADS)} (default: {', '.join(DEFAULT_WORKLOADS)})",
    )
    ap.add_argument("--gateway-workers", type=int, default=1, help="unbroken gateway --workers")
    ap.add_argument(
        "--gateway-replicas",
        type=int,
        default=1,
        help="unbroken gateways side by side in front of the same engines, the users spread "
        "over them (as pods behind a Kubernetes Service), each with --gateway-workers",
    )
    ap.add_argument(
        "--prefix-share",
        action="store_true",
        help="a redis-server for the run, the gateways' prefix_share_url",
    )
    ap.add_argument("--no-peer", action="store_true", help="skip vllm-router")
    ap.add_argument("--json", type=Path, help="also save the passes as JSON here")
    args = ap.parse_args()
    routers = parse_routers(args.routers)
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if bad := [w for w in workloads if w not in WORKLOADS]:
        raise SystemExit(f"routing.py: unknown workload(s) {bad} (known: {', '.join(WORKLOADS)})")
    args.routing_flag = gateway_has_routing()
    needs_flag = [r for r in routers if r in GATEWAY_POLICIES and r != "latency"]
    if needs_flag and not args.routing_flag:
        raise SystemExit(
            "routing.py: `unbroken gateway` has no --routing flag (issue 23's routing "
            f"policies have not landed), needed for: {', '.join(needs_flag)}. "
            "Run with --routers latency,vllm-router:round_robin,vllm-router:cache_aware "
            "meanwhile."
        )
    peer, peer_why = None, ""
    if any(r.startswith("vllm-router:") for r in routers):
        peer, peer_why = (None, "--no-peer") if args.no_peer else install_peer()
        if peer is None:
            print(f"vllm-router: not run: {peer_why}", file=sys.stderr)
    logs = Path(tempfile.mkdtemp(prefix="ub-routing-"))
    args.share_config = None
    redis: subprocess.Popen[bytes] | None = None
    if args.prefix_share:
        redis, args.share_config = _start_redis(logs)
        await asyncio.sleep(0.5)
    t_start, load0 = time.monotonic(), os.getloadavg()
    passes: list[Pass] = []
    try:
        for w in workloads:
            for r in routers:
                if r.startswith("vllm-router:") and peer is None:
                    passes.append(Pass(w, r, why=peer_why))
                    continue
                passes.append(await one_pass(w, r, args, logs, peer))
    finally:
        if redis is not None:
            redis.kill()
            redis.wait()
    la = os.getloadavg()
    peer_line = f"vllm-router {peer_version(peer)}" if peer else f"vllm-router: {peer_why}"
    print(
        f"\nmachine: {platform.node()} {platform.machine()}, "
        f"{len(os.sched_getaffinity(0))} cpus, load average {load0[0]:.2f} at the start, "
        f"{la[0]:.2f} at the end; {args.engines} engines ({' '.join(ENGINE_ARGS)}), fresh for "
        f"every pass; {args.users} users, "
        + ", ".join(f"{duration_of(w, args.duration):g} s a {w} pass" for w in workloads)
        + f" ({args.ramp:g} s ramp), "
        f"seed {args.seed}; unbroken gateway --workers {args.gateway_workers} x "
        f"{args.gateway_replicas} replica(s)"
        f"{' sharing prefixes through Redis' if args.prefix_share else ''}; {peer_line}; "
        f"{time.monotonic() - t_start:.0f} s in all; logs in {logs}"
    )
    for w in workloads:
        spec = ", ".join(f"{k}={v}" for k, v in asdict(WORKLOADS[w]).items() if k != "name")
        print(f"\n{w} ({spec})")
        print(workload_table([p for p in passes if p.workload == w]))
        print(f"\n{w}: TTFT parts (means, ms; per request)")
        print(parts_table([p for p in passes if p.workload == w]))
    print(
        "\nTTFT and ITL: the client's, over the requests that succeeded. hit rate: prompt "
        "tokens found in the engines' prefix caches / prompt tokens looked up, all engines "
        "(vllm:prefix_cache_hits_total / _queries_total). busiest/least: requests served by "
        "the busiest engine / by the least busy. errors: requests not ok (error, rejected, "
        "dropped or corrupted)."
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        out = {
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "engines": args.engines,
            "engine_args": list(ENGINE_ARGS),
            "workloads": {w: asdict(WORKLOADS[w]) for w in workloads},
            "config": {k: str(v) for k, v in vars(args).items()},
            "peer": peer_line,
            "passes": [asdict(p) for p in passes],
        }
        args.json.write_text(json.dumps(out, indent=1))
        print(f"saved {args.json}")


if __name__ == "__main__":
    asyncio.run(main())
