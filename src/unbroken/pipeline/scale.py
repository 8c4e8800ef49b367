"""Resize one pool (autoscaling), with the rollout's own steps.

Up: `k` replicas brought in together through the surge path (page-cache pre-warm, stage 1
`/health`, stage 2 a warm-up completion, registered, ready in the gateway), the pool's
declared size raised as each one serves; a replica that fails its stages is torn down and the
summary says so. Down: as many replicas as asked, those holding the fewest streams in the
gateway's view (the newest on a tie), leave through the drain path together: the declared
size drops first (so the supervisor does not replace them), the gateway drains them with a
deadline and migrates what is left by continuation to the replicas that stay, then they are
stopped. A pool going to zero whose model no other pool serves has nowhere to continue a
stream: it waits for its streams to end (`LAST_REPLICA_WAIT_S`) unless the request names a
deadline. Never outside the pool's [min, max].

The controller's autoscaler (controller/autoscale.py) decides; nothing here knows why.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from unbroken.clients import AdminError
from unbroken.pipeline.backend import Backend, ReplicaHandle
from unbroken.pipeline.rollout import (
    Progress,
    RolloutError,
    _retire,
    _wait_state,
    find_pool,
    require_pool,
    surge,
)

__all__ = ["ScaleRequest", "run_scale"]


class ScaleRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    pool: str = Field(min_length=1, max_length=63)
    replicas: int = Field(ge=0, le=64)
    reason: str = Field(default="", max_length=500)
    # None: the pool's scaling.drain_deadline_s.
    drain_deadline_s: float | None = Field(default=None, ge=0)
    warmup_budget_s: float = Field(default=10.0, gt=0)
    # None: the new replica's pool's engine.health_timeout_s.
    health_timeout_s: float | None = Field(default=None, gt=0)
    ready_timeout_s: float = Field(default=30.0, gt=0)


# A pool scaled to zero whose model nothing else serves waits this long for its streams to
# end (under the 600 s a `unbroken scale` waits for its answer), instead of the drain
# deadline, past which they could be continued nowhere.
LAST_REPLICA_WAIT_S = 570.0

# Memory a machine keeps free after a scale-up: the page cache that pre-warm relies on, the
# gateway's buffers, the kernel's own.
MEM_HEADROOM = 512 * 2**20


def _rss(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def fits(sup: Backend, pool: str, want: int) -> tuple[int, str | None]:
    """How many of `want` new replicas of `pool` this machine can hold: each is counted at
    the largest resident size of the pool's live replicas (an engine's memory is mostly its
    weights and KV cache, the same for every replica of a pool), against MemAvailable less
    MEM_HEADROOM. Unknown sizes (no live replica, no /proc) limit nothing."""
    sizes = [s for r in sup.replicas_of(pool) if r.pid and (s := _rss(r.pid))]
    avail = _available()
    if not sizes or avail is None:
        return want, None
    each = max(sizes)
    room = max(0, (avail - MEM_HEADROOM) // each)
    if room >= want:
        return want, None
    why = (
        f"memory: {avail / 2**20:.0f} MiB available holds {room} more replica(s) of "
        f"{each / 2**20:.0f} MiB (keeping {MEM_HEADROOM // 2**20} MiB free), not {want}"
    )
    return int(room), why


async def _victims(sup: Backend, pool: str, k: int) -> list[ReplicaHandle]:
    """The `k` replicas that cost least to retire: fewest streams in the gateway, newest on
    a tie (their page cache and prefix cache are the coldest)."""
    live = [r for r in sup.replicas_of(pool) if r.serving]
    try:
        inflight = {e["name"]: int(e.get("inflight", 0)) for e in await sup.admin.endpoints()}
    except AdminError:
        inflight = {}
    order = {r.name: i for i, r in enumerate(live)}  # replicas_of is oldest first
    return sorted(live, key=lambda r: (inflight.get(r.name, 0), -order[r.name]))[:k]


def _served_elsewhere(sup: Backend, pool: str, model: str) -> bool:
    """Does a serving replica of another pool serve `model` (a continuation target)?"""
    return any(
        p.name != pool
        and p.model_of(sup.spec) == model
        and any(r.serving for r in sup.replicas_of(p.name))
        for p in sup.spec.pools
    )


async def run_scale(sup: Backend, req: ScaleRequest, progress: Progress) -> dict[str, Any]:
    pool = require_pool(sup, req.pool)
    lo, hi = pool.min_replicas, pool.max_replicas
    if not lo <= req.replicas <= hi:
        raise RolloutError(
            f"pool {pool.name} may have {lo} to {hi} replicas, not {req.replicas}"
            if pool.autoscale
            else f"pool {pool.name} has a fixed size of {lo} replica(s), not "
            f"{req.replicas}: give it a range in the spec (replicas: {{min: M, max: N}}) to "
            "scale it"
        )
    t_start = time.monotonic()
    before = pool.replicas

    async def say(kind: str, **data: Any) -> None:
        sup.record(f"scale_{kind}", pool=pool.name, **data)
        await progress({"event": kind, "t": time.time(), **data})

    await say("started", replicas=before, to=req.replicas, reason=req.reason)
    added: list[str] = []
    removed: list[str] = []
    errors: list[str] = []
    limited: str | None = None
    if req.replicas > before:
        n, limited = fits(sup, pool.name, req.replicas - before)
        if limited is not None:
            await say("limited", reason=limited, adding=n)

        async def one() -> None:
            try:
                new = await surge(sup, pool, req, say)
            except RolloutError as e:
                errors.append(str(e))
                return
            added.append(new.name)
            base = find_pool(sup, pool.name) or pool
            sup.set_pool(base.model_copy(update={"replicas": min(hi, base.replicas + 1)}))

        await asyncio.gather(*(one() for _ in range(n)))
    elif req.replicas < before:
        deadline = (
            req.drain_deadline_s
            if req.drain_deadline_s is not None
            else pool.scaling.drain_deadline_s
        )
        model = pool.model_of(sup.spec)
        if (
            req.replicas == 0
            and req.drain_deadline_s is None
            and not _served_elsewhere(sup, pool.name, model)
        ):
            # Nothing else serves this model: a stream left at the deadline could be
            # continued nowhere and would be cut. Its streams are waited for instead.
            deadline = LAST_REPLICA_WAIT_S
            await say(
                "waiting",
                reason=f"no other pool serves {model}: its streams end first",
                deadline_s=deadline,
            )
        victims = await _victims(sup, pool.name, before - req.replicas)
        # The declared size first, so the supervisor does not replace what leaves; then every
        # leaving replica drains at once, so none is chosen to continue another's streams.
        sup.set_pool(pool.model_copy(update={"replicas": req.replicas}))

        async def retire(old: ReplicaHandle) -> None:
            t0 = time.monotonic()
            try:
                await _retire(sup, old, deadline)
                await say("draining", old=old.name, deadline_s=deadline)
                if not await _wait_state(sup, old.name, lambda e: e is None, deadline + 15.0):
                    with contextlib.suppress(AdminError):
                        await sup.admin.remove(name=old.name)
            except AdminError as e:
                await say("drain_failed", old=old.name, reason=str(e))
            code = await sup.stop_replica(old, timeout=15)
            removed.append(old.name)
            await say(
                "removed", old=old.name, drain_s=round(time.monotonic() - t0, 3), exit_code=code
            )

        await asyncio.gather(*(retire(v) for v in victims))
    now = find_pool(sup, pool.name)
    summary = {
        "ok": not errors,
        "pool": pool.name,
        "from": before,
        "to": req.replicas,
        "replicas": (now or pool).replicas,
        "added": added,
        "removed": removed,
        "errors": errors,
        "limited": limited,
        "seconds": round(time.monotonic() - t_start, 3),
    }
    await say("finished", **{k: v for k, v in summary.items() if k != "pool"})
    return summary
