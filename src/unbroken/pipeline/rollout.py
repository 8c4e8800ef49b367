"""Zero-downtime rolling upgrade of one pool, driven by the supervisor.

For each replica of the pool, one at a time: pre-warm its weight files into the page cache,
start the new version beside it (surge one),
stage 1 (`/health`), stage 2 (a real warm-up completion within its latency budget), register
it with the gateway, wait until it is ready there, drain the old replica with a deadline (the
gateway migrates what is still running at the deadline), SIGTERM it, wait for its exit. A new
replica that fails either stage is torn down and the rollout stops: the old replica never
stopped serving. Replicas that died before their turn are skipped (the supervisor replaces
them), one that dies during its drain counts as drained, and every way out of a rollout ends
with the pool's live count checked against its declared size: the summary says what is
missing, never less.

The steps talk to a `Backend` (pipeline/backend.py), not to the supervisor itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from unbroken.clients import AdminError, AdminRejected
from unbroken.config.spec import EngineSpec, PoolSpec, format_errors
from unbroken.pipeline.backend import Backend, ReplicaHandle

__all__ = ["RolloutError", "RolloutRequest", "run_rollout", "surge"]

Progress = Callable[[dict[str, Any]], Awaitable[None]]


class RolloutError(RuntimeError):
    pass


class RolloutRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    pool: str
    engine: dict[str, Any] = Field(default_factory=dict, description="EngineSpec fields to change")
    drain_deadline_s: float = Field(default=30.0, ge=0)
    warmup_budget_s: float = Field(default=10.0, gt=0)
    # None: the new replica's pool's engine.health_timeout_s.
    health_timeout_s: float | None = Field(default=None, gt=0)
    ready_timeout_s: float = Field(default=30.0, gt=0)


@dataclass
class Step:
    old: str
    new: str | None = None
    stage1_s: float | None = None
    stage2_s: float | None = None
    drain_s: float | None = None
    ok: bool = False
    error: str | None = None


def new_engine(old: EngineSpec, update: dict[str, Any]) -> EngineSpec:
    data = old.model_dump()
    for k, v in update.items():
        if k == "overrides" and isinstance(v, dict):
            data["overrides"] = {**data.get("overrides", {}), **v}
        else:
            data[k] = v
    try:
        return EngineSpec.model_validate(data)
    except ValidationError as e:
        raise RolloutError(f"invalid engine update: {format_errors(e)}") from None


async def _warmup(sup: Backend, r: ReplicaHandle, budget: float, model: str | None = None) -> float:
    body = {
        "model": model or sup.spec.model,
        "prompt": "warm up",
        "max_tokens": 1,
        "temperature": 0,
    }
    t0 = time.monotonic()
    try:
        async with (
            aiohttp.ClientSession() as s,
            s.post(
                r.url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=budget)
            ) as resp,
        ):
            await resp.read()
            if resp.status != 200:
                raise RolloutError(f"warm-up completion answered {resp.status}")
    except (aiohttp.ClientError, TimeoutError) as e:
        raise RolloutError(
            f"warm-up completion failed within {budget:g} s: {type(e).__name__}"
        ) from None
    took = time.monotonic() - t0
    if took > budget:
        raise RolloutError(f"warm-up took {took:.2f} s, over its {budget:g} s budget")
    return took


async def _wait_state(
    sup: Backend, name: str, want: Callable[[dict[str, Any] | None], bool], timeout: float
) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        eps = {e["name"]: e for e in await sup.admin.endpoints()}
        if want(eps.get(name)):
            return True
        await asyncio.sleep(0.05)
    return False


def find_pool(sup: Backend, name: str) -> PoolSpec | None:
    """The pool named `name` as the backend runs it now (set_pool keeps it current)."""
    return next((p for p in sup.spec.pools if p.name == name), None)


def require_pool(sup: Backend, name: str) -> PoolSpec:
    """`find_pool`, or the RolloutError a caller of rollout, convert or scale sees."""
    pool = find_pool(sup, name)
    if pool is None:
        raise RolloutError(
            f"no pool named {name!r} (pools: {', '.join(p.name for p in sup.spec.pools)})"
        )
    return pool


async def run_rollout(sup: Backend, req: RolloutRequest, progress: Progress) -> dict[str, Any]:
    pool = require_pool(sup, req.pool)
    engine = new_engine(pool.engine, req.engine)
    new_pool = pool.model_copy(update={"engine": engine})
    olds = sup.replicas_of(pool.name)
    t_start = time.monotonic()
    steps: list[Step] = []

    async def say(kind: str, **data: Any) -> None:
        sup.record(f"rollout_{kind}", pool=pool.name, **data)
        await progress({"event": kind, "t": time.time(), **data})

    await say("started", replicas=len(olds), engine=engine.model_dump(exclude_defaults=True))
    for i, old in enumerate(olds, 1):
        step = Step(old=old.name)
        steps.append(step)
        if not old.alive:
            step.error = "skipped: the replica had died (the supervisor replaces it)"
            await say("skipped", old=old.name, reason=step.error)
            continue
        t0 = time.monotonic()

        async def surged(
            new: ReplicaHandle, step: Step = step, i: int = i, old: ReplicaHandle = old
        ) -> None:
            step.new = new.name
            await say("surge", index=i, old=old.name, new=new.name, pid=new.pid)

        async def stage(
            kind: str, new: ReplicaHandle, took: float, step: Step = step, t0: float = t0
        ) -> None:
            if kind == "stage1":
                step.stage1_s = time.monotonic() - t0
                await say("stage1", new=new.name, seconds=round(step.stage1_s, 3))
            else:
                step.stage2_s = took
                await say("stage2", new=new.name, seconds=round(took, 3))

        try:
            new = await surge(sup, new_pool, req, say, on_surge=surged, on_stage=stage)
        except RolloutError as e:
            step.error = str(e)
            return await _finish(sup, say, pool.name, pool.replicas, steps, t_start, step.error)
        t0 = time.monotonic()
        try:
            await _retire(sup, old, req.drain_deadline_s)
            await say("draining", old=old.name, deadline_s=req.drain_deadline_s)
            gone = await _wait_state(
                sup, old.name, lambda e: e is None, req.drain_deadline_s + 15.0
            )
            if not gone:  # should not happen: at the deadline the gateway migrates the rest
                with contextlib.suppress(AdminError):
                    await sup.admin.remove(name=old.name)
        except AdminError as e:
            # The gateway is unreachable: stop the old one anyway (the new one serves).
            await say("drain_failed", old=old.name, reason=str(e))
        step.drain_s = time.monotonic() - t0
        code = await sup.stop_replica(old, timeout=15)
        step.ok = True
        await say(
            "replaced", old=old.name, new=new.name, drain_s=round(step.drain_s, 3), exit_code=code
        )
    sup.set_pool(new_pool)  # replacements from now on run the new version
    return await _finish(sup, say, pool.name, pool.replicas, steps, t_start, None)


class _Timeouts(Protocol):
    warmup_budget_s: float
    health_timeout_s: float | None
    ready_timeout_s: float


async def surge(
    sup: Backend,
    pool: PoolSpec,
    req: _Timeouts,
    say: Callable[..., Awaitable[None]],
    *,
    on_surge: Callable[[ReplicaHandle], Awaitable[None]] | None = None,
    on_stage: Callable[[str, ReplicaHandle, float], Awaitable[None]] | None = None,
) -> ReplicaHandle:
    """Bring one new replica of `pool` into service beside the old ones: pre-warm its
    weights, start it, stage 1 (`/health`), stage 2 (a warm-up completion within budget),
    register it with the gateway in `pool`, wait until the gateway has it ready, adopt it.
    Anything failing on the way tears the new replica down and raises RolloutError; the old
    replicas were never touched (rollouts and conversions both start this way)."""
    new: ReplicaHandle | None = None
    registered = False
    try:
        warmed = await sup.prewarm(pool)
        if warmed is not None:
            await say("prewarm", **warmed)
        new = await sup.start_replica(pool)
        if on_surge is not None:
            await on_surge(new)
        limit = req.health_timeout_s or pool.engine.health_timeout_s
        try:
            await sup.wait_health(new, timeout=limit)
        except TimeoutError:
            raise RolloutError(
                f"{new.name} failed stage 1: no /health within {limit:g} s"
            ) from None
        if on_stage is not None:
            await on_stage("stage1", new, 0.0)
        took = await _warmup(sup, new, req.warmup_budget_s, pool.model_of(sup.spec))
        if on_stage is not None:
            await on_stage("stage2", new, took)
        await sup.admin.add(url=new.url, name=new.name, pool=pool.name, cap=pool.cap, warmup=False)
        registered = True
        if not await _wait_state(
            sup, new.name, lambda e: bool(e and e["state"] == "ready"), req.ready_timeout_s
        ):
            raise RolloutError(f"{new.name} did not become ready in the gateway")
        sup.adopt(new)
        await say("ready", new=new.name)
        return new
    except Exception as e:  # any failure before an old replica is touched: undo the new one
        why = str(e) if isinstance(e, RolloutError) else f"{type(e).__name__}: {e}"
        await say("rollback", new=new.name if new else None, reason=why)
        if registered and new is not None:
            with contextlib.suppress(AdminError):
                await sup.admin.remove(name=new.name)
        if new is not None:
            with contextlib.suppress(Exception):
                await sup.stop_replica(new, timeout=5)
        raise RolloutError(why) from None


async def _retire(sup: Backend, old: ReplicaHandle, deadline_s: float) -> None:
    """Drain `old`; one the gateway no longer knows (it died and was removed) is done."""
    try:
        await sup.admin.drain(name=old.name, deadline_s=deadline_s)
    except AdminRejected as e:
        if e.status != 404:
            raise


async def _finish(
    sup: Backend,
    say: Callable[..., Awaitable[None]],
    pool: str,
    declared: int,
    steps: list[Step],
    t0: float,
    error: str | None,
) -> dict[str, Any]:
    """The summary, with the pool's live size checked against its declared size."""
    live = sum(1 for r in sup.replicas_of(pool) if r.serving)
    missing = max(0, declared - live)
    summary = _summary(pool, steps, t0, ok=error is None, error=error)
    summary["replicas"] = {"declared": declared, "live": live, "missing": missing}
    if missing:
        note = (
            f"pool {pool} has {live} of its {declared} replica(s); the supervisor is "
            f"replacing the {missing} missing (see `unbroken status`)"
        )
        summary["error"] = f"{error}; {note}" if error else note
    kind = "finished" if error is None else "stopped"
    await say(kind, seconds=summary["seconds"], **summary["replicas"])
    return summary


def _summary(
    pool: str, steps: list[Step], t0: float, *, ok: bool, error: str | None = None
) -> dict[str, Any]:
    return {
        "pool": pool,
        "ok": ok,
        "error": error,
        "seconds": round(time.monotonic() - t0, 3),
        "steps": [
            {
                "old": s.old,
                "new": s.new,
                "stage1_s": s.stage1_s,
                "stage2_s": s.stage2_s,
                "drain_s": s.drain_s,
                "ok": s.ok,
                "error": s.error,
            }
            for s in steps
        ],
    }
