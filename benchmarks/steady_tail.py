"""The demo's steady window alone, standard deployment against unbroken, alternated.

`unbroken demo` takes ~3 minutes and its steady p99.9 TTFT (issue 23: <= 1.1x the standard
deployment's) is the 2nd-3rd slowest of ~1,300 first tokens, so one run says little. This
runs only that window: the demo's spec, engines, 200 users and priority mix, a ramp, then
`--steady` seconds measured, for each target in turn, `--rounds` times, alternating the order
(~50 s a target). Per target: TTFT p50 / p99 / p99.9 over the window (and per engine class,
from the simulator's X-Unbroken-Profile), its ratio to the standard deployment of the same
round, and the CPU each role used in the window (cores): the load generator (this process),
gateway or round-robin proxy, engines, controller, agent; and per engine class the window's
completed requests with their time per output token, end-to-end time and time after the
last token (printed after each target).

Variants of unbroken (`--variant NAME:key=value,...`, spec paths under the pipeline spec,
e.g. `nice0:gateway.nice=0`, `noctl:controller.enabled=false`; a
key `env.NAME` sets an environment variable of the pipeline's processes instead) run as
extra targets in each round. `--burn FRACTION` runs a busy loop using that share of a core
beside the standard deployment, as a second standard target ("standard+burn"): whether a
gateway's CPU alone makes the round-robin's tail what unbroken's is. `--rollout` then rolls
the primary pool under the same load (the demo's rolling upgrade, without the demo's
storage cap or contention before it) and reports that window's p99.9 against the steady
one: a routing change that herds requests while streams move shows there, not in the
steady window (2026-12-06: the step phase, docs/bench.md).

    .venv/bin/python benchmarks/steady_tail.py --rounds 3
    .venv/bin/python benchmarks/steady_tail.py --rounds 2 --rollout
    .venv/bin/python benchmarks/steady_tail.py --rounds 2 --burn 0.35 \
        --variant noctl:controller.enabled=false
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console

from _common import cpu_seconds, process_tree
from unbroken.bench.baseline import StandardDeployment
from unbroken.bench.demo import PRIORITIES, _spec
from unbroken.bench.load import LoadConfig, LoadRun
from unbroken.bench.passes import StandardTarget, UnbrokenTarget
from unbroken.bench.priority import measuring_priority
from unbroken.bench.stats import percentile
from unbroken.config.spec import PipelineSpec
from unbroken.pipeline.supervisor import Supervisor


@dataclass
class Target:
    name: str
    kind: str  # "standard" or "unbroken"
    sets: dict[str, str] = field(default_factory=dict)
    burn: float = 0.0


@dataclass
class Result:
    target: str
    round: int
    ttfts: list[float]
    by_profile: dict[str, list[float]]
    cpu: dict[str, float]  # cores per role over the window
    failed: int
    # `--rollout`: first-token times of the requests started while the primary pool rolled
    # (the demo's rolling-upgrade window, right after the steady one), and their failures.
    rollout: list[float] = field(default_factory=list)
    rollout_failed: int = 0
    # Per engine class, the window's completed requests: how many, their time per output
    # token and end-to-end time (p50, ms), and how long the response went on after its last
    # token (p50 / p99, ms: the usage chunk, [DONE], the end of the chunked body).
    flow: dict[str, str] = field(default_factory=dict)


def _role(pid: int) -> str | None:
    """What a descendant is, by its command: `python -m unbroken SUBCOMMAND ...`, the
    simulator's `-m unbroken.engine`, the round-robin Service's `-m unbroken.bench.rrproxy`."""
    try:
        argv = [
            a.decode(errors="replace")
            for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        ]
    except OSError:
        return None
    roles = {
        "engine": "engines",
        "unbroken.engine": "engines",
        "gateway": "gateway",
        "unbroken.bench.rrproxy": "gateway",
        "unbroken.gateway._worker": "gateway",
        "controller": "controller",
        "agent": "agent",
    }
    for a in argv[1:4]:
        if a in roles:
            return roles[a]
    return "other"


def _children_cpu() -> dict[int, tuple[str, float]]:
    """CPU seconds (utime + stime) of every descendant of this process, with its role."""
    me = os.getpid()
    out: dict[int, tuple[str, float]] = {}
    for pid in process_tree(me):
        if pid == me:
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            role = _role(pid)
            if role is not None:
                out[pid] = (role, cpu_seconds(pid))
    return out


def _self_cpu() -> float:
    t = os.times()
    return t.user + t.system


def _cpu_delta(
    a: dict[int, tuple[str, float]], b: dict[int, tuple[str, float]], seconds: float
) -> dict[str, float]:
    roles: dict[str, float] = {}
    for pid, (role, cpu) in b.items():
        roles[role] = roles.get(role, 0.0) + cpu - a.get(pid, (role, 0.0))[1]
    return {k: round(v / seconds, 3) for k, v in sorted(roles.items())}


def _burner(fraction: float, stop: Any) -> None:
    """A busy loop using `fraction` of a core in 10 ms periods."""
    busy = 0.01 * fraction
    while not stop.is_set():
        t = time.perf_counter()
        while time.perf_counter() - t < busy:
            pass
        time.sleep(max(0.0, 0.01 - busy))


def _apply(spec: PipelineSpec, sets: dict[str, str]) -> PipelineSpec:
    data = spec.model_dump()
    for path, raw in sets.items():
        node = data
        *parents, last = path.split(".")
        for p in parents:
            node = node[p]
        value: Any = raw
        if raw.lower() in ("true", "false"):
            value = raw.lower() == "true"
        else:
            with contextlib.suppress(ValueError):
                value = float(raw) if "." in raw else int(raw)
        node[last] = value
    return PipelineSpec.model_validate(data)


def _state(root: Path, name: str) -> tuple[Path, str, Path]:
    state = root / name
    state.mkdir(parents=True)
    token = secrets.token_urlsafe(16)
    token_file = state / "admin-token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    return state, token, token_file


async def _one(
    t: Target, rnd: int, root: Path, args: argparse.Namespace, console: Console
) -> Result:
    state, token, token_file = _state(root, f"{t.name}-{rnd}")
    env = {k[4:]: v for k, v in t.sets.items() if k.startswith("env.")}
    spec = _apply(
        _spec(args.weights_size), {k: v for k, v in t.sets.items() if not k.startswith("env.")}
    )
    target: Any
    if t.kind == "standard":
        dep = StandardDeployment(spec, state=state, token=token, token_file=token_file)
        target = StandardTarget(dep)
    else:
        target = UnbrokenTarget(Supervisor(spec, state=state, token=token, token_file=token_file))
    cfg = LoadConfig(
        url=target.url,
        users=args.users,
        spawn_rate=max(10.0, args.users / 5),
        duration=3600,
        priorities=PRIORITIES,
    )
    stop_burn = multiprocessing.Event()
    burner: multiprocessing.Process | None = None
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the pipeline's processes inherit it
    try:
        await target.start(console)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        if t.burn > 0:
            burner = multiprocessing.Process(target=_burner, args=(t.burn, stop_burn), daemon=True)
            burner.start()
        load = LoadRun(cfg)
        with measuring_priority(True):
            runner = asyncio.create_task(load.run())
            await asyncio.sleep(args.users / cfg.spawn_rate + args.ramp)
            t0, c0, s0 = load.now(), _children_cpu(), _self_cpu()
            spies = _profile_gateway(c0, t, rnd, args)
            await asyncio.sleep(args.steady)
            for spy in spies:
                await asyncio.to_thread(spy.wait)
            t1, c1, s1 = load.now(), _children_cpu(), _self_cpu()
            r0 = r1 = t1
            if args.rollout:
                await target.rollout(args.deadline)
                r1 = load.now()
            load.stop()
            await runner
    finally:
        stop_burn.set()
        if burner is not None:
            burner.join(timeout=2)
        await target.stop()
    window = [r for r in load.records if t0 <= r.start < t1]
    if args.dump:
        # Each first token on the host's monotonic clock, to set beside the pipeline's logs.
        out = Path(args.dump) / f"{t.name}-{rnd}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(
            orjson.dumps(
                [[load.t0 + r.start, r.ttft, r.endpoint or r.profile, r.priority] for r in window]
            )
        )
    cpu = _cpu_delta(c0, c1, t1 - t0)
    cpu["loadgen"] = round((s1 - s0) / (t1 - t0), 3)
    # The engine's own X-Unbroken-Profile through the L4 proxy; the gateway's endpoint name
    # (POOL-N) and the pool's precision through unbroken.
    precision = {p.name: p.precision for p in spec.pools}
    by: dict[str, list[float]] = {}
    for r in window:
        if r.ttft is not None:
            by.setdefault(_profile(r, precision), []).append(r.ttft)
    rolled = [r for r in load.records if r0 <= r.start < r1]
    flow: dict[str, str] = {}
    done = [r for r in window if r.outcome == "ok" and r.ttft is not None and r.end is not None]
    for prof in sorted({_profile(r, precision) for r in done}):
        rs = [r for r in done if _profile(r, precision) == prof]
        tpot = [x for r in rs if (x := r.tpot) is not None]
        after = [r.end - r.start - r.ttft - sum(r.gaps) for r in rs]  # type: ignore[operator]
        flow[prof] = (
            f"{len(rs)} done, TPOT p50 {_ms(tpot, 50):.1f}, e2e p50 "
            f"{_ms([r.e2e for r in rs if r.e2e is not None], 50):.0f}, after the last token "
            f"p50 {_ms(after, 50):.2f} / p99 {_ms(after, 99):.2f}"
        )
    return Result(
        target=t.name,
        round=rnd,
        ttfts=[r.ttft for r in window if r.ttft is not None],
        by_profile=by,
        cpu=cpu,
        failed=sum(1 for r in window if r.outcome not in ("ok", "pending")),
        rollout=[r.ttft for r in rolled if r.ttft is not None],
        rollout_failed=sum(1 for r in rolled if r.outcome not in ("ok", "pending")),
        flow=flow,
    )


def _profile_gateway(
    procs: dict[int, tuple[str, float]], t: Target, rnd: int, args: argparse.Namespace
) -> list[subprocess.Popen[bytes]]:
    """`--profile DIR`: py-spy (raw stacks, idle samples left out) on each of the gateway's
    processes for the window; the profiler's own CPU lands on the machine the tail is measured
    on, so a profiled round's ratios are not comparable with the others."""
    if not args.profile:
        return []
    spy = Path(sys.executable).with_name("py-spy")
    out = Path(args.profile)
    out.mkdir(parents=True, exist_ok=True)
    return [
        subprocess.Popen(
            [
                str(spy),
                "record",
                "--nonblocking",
                "--format",
                "raw",
                "--rate",
                "200",
                "--duration",
                str(int(args.steady)),
                "--pid",
                str(pid),
                "-o",
                str(out / f"{t.name}-{rnd}-{pid}.txt"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for pid, (role, _) in procs.items()
        if role == "gateway"
    ]


def _profile(r: Any, precision: dict[str, str]) -> str:
    return r.profile or precision.get((r.endpoint or "").rsplit("-", 1)[0], "?")


def _ms(xs: list[float], q: float) -> float:
    v = percentile(xs, q)
    return float("nan") if v is None else v * 1e3


def _rolled(r: Result) -> str:
    """The rollout window's p99.9 and its ratio to the same target's steady p99.9 (the
    demo's check: <= 1.5x), with its failures."""
    if not r.rollout:
        return "-"
    p = _ms(r.rollout, 99.9)
    return f"{p:.1f} ({p / _ms(r.ttfts, 99.9):.2f}x), {r.rollout_failed} failed"


def _table(results: list[Result]) -> str:
    std = {r.round: r for r in results if r.target == "standard"}
    rolled = any(r.rollout for r in results)
    head = (
        "| round | target | first tokens | TTFT p50 | p99 | p99.9 | p99.9 vs standard | "
        "fp16 p99 | fp8 p99 | CPU cores: loadgen / gateway / engines / controller / agent | "
        "failed |" + (" rollout p99.9 (x steady) |" if rolled else "")
    )
    lines = [head, "|" + "---|" * (12 if rolled else 11)]
    for r in results:
        base = std.get(r.round)
        ratio = (
            f"{_ms(r.ttfts, 99.9) / _ms(base.ttfts, 99.9):.2f}x"
            if base is not None and base.ttfts
            else "-"
        )
        cpu = " / ".join(
            f"{r.cpu.get(k, 0.0):.2f}"
            for k in ("loadgen", "gateway", "engines", "controller", "agent")
        )
        lines.append(
            f"| {r.round} | {r.target} | {len(r.ttfts)} | {_ms(r.ttfts, 50):.1f} | "
            f"{_ms(r.ttfts, 99):.1f} | {_ms(r.ttfts, 99.9):.1f} | {ratio} | "
            f"{_ms(r.by_profile.get('fp16', []), 99):.1f} | "
            f"{_ms(r.by_profile.get('fp8', []), 99):.1f} | {cpu} | {r.failed} |"
            + (f" {_rolled(r)} |" if rolled else "")
        )
    names = list(dict.fromkeys(r.target for r in results))
    summary = [
        "",
        "| target | median p99.9 ms | median p99.9 vs standard | median p99 ms |",
        "|---|---|---|---|",
    ]
    for n in names:
        rs = [r for r in results if r.target == n]
        ratios = [
            _ms(r.ttfts, 99.9) / _ms(std[r.round].ttfts, 99.9)
            for r in rs
            if r.round in std and std[r.round].ttfts
        ]
        summary.append(
            f"| {n} | {statistics.median(_ms(r.ttfts, 99.9) for r in rs):.1f} | "
            f"{statistics.median(ratios):.2f}x | "
            f"{statistics.median(_ms(r.ttfts, 99) for r in rs):.1f} |"
        )
    return "\n".join(lines + summary)


def _targets(args: argparse.Namespace) -> list[Target]:
    ts = [Target("standard", "standard"), Target("unbroken", "unbroken")]
    if args.burn > 0:
        ts.append(Target(f"standard+burn{args.burn:g}", "standard", burn=args.burn))
    for v in args.variant:
        name, _, sets = v.partition(":")
        kv = dict(s.split("=", 1) for s in sets.split(",") if s)
        ts.append(Target(name, "unbroken", sets=kv))
    return ts


async def _main(args: argparse.Namespace) -> None:
    console = Console()
    targets = _targets(args)
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="steady-tail-") as tmp:
        for rnd in range(1, args.rounds + 1):
            order = targets if rnd % 2 else list(reversed(targets))
            for t in order:
                console.print(f"round {rnd}: {t.name}")
                res = await _one(t, rnd, Path(tmp), args, console)
                console.print(
                    f"  p50 {_ms(res.ttfts, 50):.1f}  p99 {_ms(res.ttfts, 99):.1f}  "
                    f"p99.9 {_ms(res.ttfts, 99.9):.1f} ms over {len(res.ttfts)}; cpu {res.cpu}"
                )
                for prof, line in res.flow.items():
                    console.print(f"  {prof}: {line}")
                results.append(res)
    results.sort(key=lambda r: (r.round, [t.name for t in targets].index(r.target)))
    print(_table(results))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--users", type=int, default=200)
    p.add_argument("--steady", type=float, default=25.0, help="seconds measured")
    p.add_argument("--ramp", type=float, default=3.0, help="seconds after the last user starts")
    p.add_argument("--weights-size", default="1GiB")
    p.add_argument("--burn", type=float, default=0.0, help="also: standard + a busy loop")
    p.add_argument(
        "--rollout",
        action="store_true",
        help="after the steady window, roll the primary pool under the same load and report "
        "its window's p99.9 against the steady one (the demo's rolling-upgrade check)",
    )
    p.add_argument("--deadline", type=float, default=5.0, help="the rollout's drain deadline")
    p.add_argument("--variant", action="append", default=[], help="NAME:key=value,...")
    p.add_argument(
        "--profile",
        default="",
        help="DIR: py-spy's raw stacks of the gateway's processes over each window",
    )
    p.add_argument(
        "--dump", default="", help="DIR: each target's first tokens (monotonic start, TTFT)"
    )
    args = p.parse_args()
    import uvloop

    uvloop.run(_main(args))


if __name__ == "__main__":
    main()
