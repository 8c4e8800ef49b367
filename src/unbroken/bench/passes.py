"""One pass of the demo: the same load and the same events against one deployment.

A pass drives the streaming users through the phases below, at the same offsets in both
passes until the rollout (whose length depends on the deployment):

    ramp-up → steady → contention (slow_cuda on fp16 replicas) → recovery → rolling upgrade
    of the primary pool → settle → SIGKILL of a primary replica (replaced) → stop

`UnbrokenTarget` is unbroken's pipeline (gateway, drain and migration, pre-warm, controller
where the spec runs one); `StandardTarget` is `baseline.StandardDeployment`. Both answer the
same calls, so the phase driver does not know which one it is measuring.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import aiohttp
from rich.console import Console

from unbroken.bench.baseline import StandardDeployment
from unbroken.bench.control import PipelineControl, Sampler
from unbroken.bench.load import LoadConfig, LoadRun, Record
from unbroken.bench.priority import measuring_priority
from unbroken.bench.runner import live_progress
from unbroken.bench.throttle import drop_page_cache
from unbroken.clients import EngineAdmin
from unbroken.pipeline.supervisor import Supervisor
from unbroken.prewarm import find_weight_files

__all__ = ["Contention", "PassResult", "Phases", "StandardTarget", "UnbrokenTarget", "run_pass"]

UPGRADE = {"overrides": {"decode_base_s": 0.018}}  # the "new version" both rollouts install


@dataclass(frozen=True)
class Contention:
    """The bus-contention episode injected on `replicas` fp16 replicas (the engine's
    `slow_cuda` fault): severity ramps up over `ramp_s`, holds, and ramps down."""

    seconds: float = 15.0
    extra_ms: float = 30.0
    factor: float = 2.0
    jitter_ms: float = 30.0
    ramp_s: float = 2.0
    replicas: int = 1

    def fault(self) -> dict[str, Any]:
        return {
            "kind": "slow_cuda",
            "extra_ms": self.extra_ms,
            "factor": self.factor,
            "jitter_ms": self.jitter_ms,
            "ramp_s": min(self.ramp_s, self.seconds / 2),
            "duration_s": self.seconds,
        }


@dataclass(frozen=True)
class Phases:
    # 40 s: ~3,500 first tokens with 200 users, so the steady p99.9 (issue 23's target and
    # the other windows' denominator) is about the 4th slowest, not the 2nd of ~1,760.
    steady_s: float = 40.0
    contention: Contention = field(default_factory=Contention)
    # Contention's end to the rollout: the controller's undo (exit dwell, then the cap steps,
    # then the routes: ~10 s with the default spec) is over before the rollout's window.
    recovery_s: float = 12.0
    deadline_s: float = 5.0
    # The rollout's end to the SIGKILL (chaos).
    settle_s: float = 4.0
    # The killed replica's replacement to the chaos window's end.
    after_kill_s: float = 4.0
    # The last user's start to the steady window (connections and first requests settle).
    ramp_s: float = 3.0


@dataclass
class PassResult:
    name: str
    url: str
    records: list[Record]
    events: list[dict[str, Any]]
    marks: dict[str, float]
    samples: list[dict[str, Any]]
    rollout: dict[str, Any]
    boot_s: float
    cold_starts: list[dict[str, Any]]  # replacement replicas of the rollout: start → ready
    prewarm: list[dict[str, Any]]
    decisions: list[dict[str, Any]]  # controller decisions, t in seconds since load start
    contended: list[str]
    loop_lag: list[float] = field(default_factory=list)  # the load generator's own lateness
    # (t, seconds late) of each wake-up LATE_S or more late: tails that coincide with one
    # were (at least partly) the measuring process's own delay
    loop_late: list[tuple[float, float]] = field(default_factory=list)
    sched: str = "normal"  # the load generator's CPU policy while it measured (priority.py)


LATE_S = 0.03


async def _lag_probe(
    out: list[float],
    late: list[tuple[float, float]],
    now: Callable[[], float],
    period: float = 0.02,
) -> None:
    """How late the load generator's event loop wakes up: if it is late, so are its
    timestamps, and the pass's latencies include the measuring process's own delay."""
    loop = asyncio.get_running_loop()
    while True:
        t = loop.time()
        await asyncio.sleep(period)
        lag = loop.time() - t - period
        out.append(lag)
        if lag >= LATE_S:
            late.append((now() - lag, lag))


class Target(Protocol):
    name: str
    url: str

    @property
    def engine_token(self) -> str: ...

    async def start(self, console: Console) -> None: ...
    def fp16_engines(self) -> list[tuple[str, str]]: ...
    async def rollout(self, deadline_s: float) -> dict[str, Any]: ...
    async def kill(self) -> dict[str, Any]: ...
    async def wait_replaced(self, name: str) -> str | None: ...
    async def collect(self, wall0: float) -> dict[str, Any]: ...
    async def stop(self) -> None: ...


def _weights(sup: Supervisor) -> list[Path]:
    files: list[Path] = []
    for pool in sup.spec.pools:
        w = sup.weights_for(pool)
        if w is not None:
            files += [f for f in find_weight_files([str(w)]) if f not in files]
    return files


class UnbrokenTarget:
    name = "unbroken"

    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup
        self.url = sup.gateway_url
        self.control = PipelineControl(str(sup.state / "supervisor.sock"))
        self.sampler = Sampler(sup.admin_url, sup.token)
        self._rollout: dict[str, Any] = {}

    @property
    def engine_token(self) -> str:
        return getattr(self.sup, "engine_token", None) or self.sup.token

    async def start(self, console: Console) -> None:
        with console.status("unbroken: starting the pipeline") as st:
            await self.sup.start(lambda m: st.update(f"unbroken: {m}"))

    def fp16_engines(self) -> list[tuple[str, str]]:
        return [
            (r.name, r.url)
            for r in sorted(self.sup.replicas.values(), key=lambda r: r.name)
            if r.pool.precision in ("fp16", "bf16") and not r.stopping
        ]

    async def rollout(self, deadline_s: float) -> dict[str, Any]:
        # Same storage as the standard deployment: the weights start out of the page cache,
        # and the rollout pre-warms them (through the throttle) while the old replica serves.
        await asyncio.get_running_loop().run_in_executor(None, drop_page_cache, _weights(self.sup))
        self._rollout = await self.control.rollout("primary", UPGRADE, deadline_s=deadline_s)
        return self._rollout

    async def kill(self) -> dict[str, Any]:
        return await self.control.kill("primary")

    async def wait_replaced(self, name: str) -> str | None:
        return await self.control.wait_replaced(name)

    async def collect(self, wall0: float) -> dict[str, Any]:
        news = [s["new"] for s in self._rollout.get("steps", []) if s.get("new")]
        cold = []
        for name in news:
            r = self.sup.replicas.get(name)
            if r is not None and r.healthy_at is not None:
                cold.append(
                    {"replica": name, "start_to_ready_s": round(r.healthy_at - r.started_at, 3)}
                )
        prewarm = [
            {k: e[k] for k in ("bytes", "seconds", "gbps") if k in e}
            for e in self.sup.events
            if e["event"] == "rollout_prewarm"
        ]
        return {
            "cold_starts": cold,
            "prewarm": prewarm,
            "decisions": await self._decisions(wall0),
            "samples": self.sampler.samples,
        }

    async def _decisions(self, wall0: float) -> list[dict[str, Any]]:
        """The controller's decision log (`GET /decisions`), when the spec runs one."""
        ctl = getattr(self.sup.spec, "controller", None)
        if ctl is None or not getattr(ctl, "enabled", False):
            return []
        url = f"http://{ctl.host}:{ctl.port}/decisions"
        try:
            async with (
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s,
                s.get(url, headers={"Authorization": f"Bearer {self.sup.token}"}) as r,
            ):
                if r.status != 200:
                    return []
                data = await r.json()
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return []
        items = data.get("decisions", []) if isinstance(data, dict) else data
        out = []
        for d in items if isinstance(items, list) else []:
            with contextlib.suppress(KeyError, TypeError, ValueError):
                out.append({**d, "t": round(float(d["t"]) - wall0, 3)})
        return out

    async def stop(self) -> None:
        await self.sampler.stop()
        await self.sup.stop()


class StandardTarget:
    name = "standard"

    def __init__(self, dep: StandardDeployment) -> None:
        self.dep = dep
        self.url = dep.url
        self.engine_token = dep.token

    async def start(self, console: Console) -> None:
        with console.status("standard: starting engines and the round-robin proxy") as st:
            await self.dep.start(lambda m: st.update(f"standard: {m}"))

    def fp16_engines(self) -> list[tuple[str, str]]:
        return [
            (r.name, r.url)
            for r in sorted(self.dep.replicas.values(), key=lambda r: r.name)
            if r.pool.precision in ("fp16", "bf16") and not r.stopping
        ]

    async def rollout(self, deadline_s: float) -> dict[str, Any]:
        return await self.dep.rollout("primary", UPGRADE)

    async def kill(self) -> dict[str, Any]:
        return await self.dep.kill("primary")

    async def wait_replaced(self, name: str) -> str | None:
        return await self.dep.wait_replaced(name)

    async def collect(self, wall0: float) -> dict[str, Any]:
        return {
            "cold_starts": [c for c in self.dep.cold_starts if c["reason"] == "rollout"],
            "prewarm": [],
            "decisions": [],
            "samples": [],
        }

    async def stop(self) -> None:
        await self.dep.stop()


async def inject(url: str, token: str, fault: dict[str, Any]) -> None:
    """Inject a fault through a simulator engine's admin API."""
    async with EngineAdmin(url, token, timeout=5) as adm:
        await adm.inject(**fault)


async def run_pass(
    target: Target,
    cfg: LoadConfig,
    phases: Phases,
    console: Console,
    *,
    realtime: bool = True,
) -> PassResult:
    t_boot = time.monotonic()
    await target.start(console)
    boot_s = time.monotonic() - t_boot
    console.print(f"{target.name}: up in {boot_s:.1f} s at {target.url}")
    load = LoadRun(cfg)
    marks: dict[str, float] = {}
    phase = "ramp-up"
    rollout: dict[str, Any] = {}
    contended: list[str] = []
    wall0 = time.time()
    collected: dict[str, Any] = {}
    lag: list[float] = []
    late: list[tuple[float, float]] = []
    try:
        with measuring_priority(realtime) as sched, live_progress(console) as prog:
            tid = prog.add_task(target.name, total=None, stats="")
            runner = asyncio.create_task(load.run())
            await asyncio.sleep(0)
            wall0 = time.time() - load.now()
            if isinstance(target, UnbrokenTarget):
                target.sampler.start(load.t0)

            async def tick() -> None:
                while True:
                    prog.update(tid, description=f"{target.name}: {phase}", stats=load.status())
                    await asyncio.sleep(0.5)

            ticker = asyncio.create_task(tick())
            prober = asyncio.create_task(_lag_probe(lag, late, load.now))

            def mark(name: str, **data: Any) -> None:
                marks[name] = load.now()
                load.mark(name, **data)

            await asyncio.sleep(cfg.users / cfg.spawn_rate + phases.ramp_s)
            phase = "steady"
            mark("steady_start")
            await asyncio.sleep(phases.steady_s)

            c = phases.contention
            phase = "contention"
            contended = [n for n, _ in target.fp16_engines()[: c.replicas]]
            urls = [u for _, u in target.fp16_engines()[: c.replicas]]
            await asyncio.gather(*(inject(u, target.engine_token, c.fault()) for u in urls))
            mark("contention_start", replicas=contended, **c.fault())
            await asyncio.sleep(c.seconds)
            mark("contention_end")
            phase = "recovery"
            await asyncio.sleep(phases.recovery_s)

            phase = "rolling upgrade of primary"
            mark("rollout_start", pool="primary")
            rollout = await target.rollout(phases.deadline_s)
            mark("rollout_end", ok=rollout.get("ok"), seconds=rollout.get("seconds"))
            phase = "settling"
            await asyncio.sleep(phases.settle_s)

            phase = "chaos: SIGKILL a primary replica"
            mark("chaos_start")
            victim = await target.kill()
            load.mark("replica_killed", replica=victim["name"], pid=victim["pid"])
            by = await target.wait_replaced(victim["name"])
            load.mark("replica_replaced", replica=victim["name"], by=by)
            await asyncio.sleep(phases.after_kill_s)
            mark("chaos_end")
            phase = "finishing"
            load.stop()
            await runner
            ticker.cancel()
            prober.cancel()
        collected = await target.collect(wall0)
    finally:
        await target.stop()
    return PassResult(
        name=target.name,
        url=target.url,
        records=load.records,
        events=load.events,
        marks=marks,
        samples=collected.get("samples", []),
        rollout=rollout,
        boot_s=boot_s,
        cold_starts=collected.get("cold_starts", []),
        prewarm=collected.get("prewarm", []),
        decisions=collected.get("decisions", []),
        contended=contended,
        loop_lag=lag,
        loop_late=late,
        sched=sched,
    )
