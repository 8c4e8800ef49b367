"""Move one replica from one pool to another (fp16 → fp8 and back) without cutting a stream:
the rollout's steps with a different target pool. Start a replica of the target pool beside the
old one (surge one, pre-warmed), stage 1 and stage 2 readiness, register it, drain the old one
with a deadline (the gateway migrates what is left), stop it, and move one replica of the
declared size from the old pool to the new one, so replacements keep the new shape.

The controller asks for it (dynamic precision) when contention on the full-precision pool
persists; nothing here knows why.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from unbroken.clients import AdminError
from unbroken.pipeline.backend import Backend, ReplicaHandle
from unbroken.pipeline.rollout import (
    Progress,
    RolloutError,
    _retire,
    _wait_state,
    require_pool,
    surge,
)

__all__ = ["ConvertRequest", "run_convert"]


class ConvertRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    endpoint: str = Field(min_length=1, max_length=128)
    to_pool: str = Field(min_length=1, max_length=63)
    drain_deadline_s: float = Field(default=30.0, ge=0)
    warmup_budget_s: float = Field(default=10.0, gt=0)
    # None: the new replica's pool's engine.health_timeout_s.
    health_timeout_s: float | None = Field(default=None, gt=0)
    ready_timeout_s: float = Field(default=30.0, gt=0)


async def run_convert(sup: Backend, req: ConvertRequest, progress: Progress) -> dict[str, Any]:
    target = require_pool(sup, req.to_pool)
    old: ReplicaHandle | None = None
    source = None
    for p in sup.spec.pools:
        for r in sup.replicas_of(p.name):
            if r.name == req.endpoint:
                old, source = r, p
    if old is None or source is None:
        raise RolloutError(f"no live replica named {req.endpoint!r}")
    if source.name == target.name:
        raise RolloutError(f"{req.endpoint} is already in pool {target.name}")
    t_start = time.monotonic()

    async def say(kind: str, **data: Any) -> None:
        sup.record(f"convert_{kind}", endpoint=req.endpoint, to_pool=target.name, **data)
        await progress({"event": kind, "t": time.time(), **data})

    await say("started", from_pool=source.name)
    try:
        new = await surge(sup, target, req, say)
    except RolloutError as e:
        return {"ok": False, "error": str(e), "endpoint": req.endpoint, "to_pool": target.name}
    # The declared sizes follow before the old one stops, so the supervisor does not
    # "replace" the replica being retired.
    sup.set_pool(source.model_copy(update={"replicas": max(0, source.replicas - 1)}))
    sup.set_pool(target.model_copy(update={"replicas": target.replicas + 1}))
    t0 = time.monotonic()
    try:
        await _retire(sup, old, req.drain_deadline_s)
        await say("draining", deadline_s=req.drain_deadline_s)
        if not await _wait_state(sup, old.name, lambda e: e is None, req.drain_deadline_s + 15):
            with contextlib.suppress(AdminError):
                await sup.admin.remove(name=old.name)
    except AdminError as e:
        await say("drain_failed", reason=str(e))
    drain_s = time.monotonic() - t0
    code = await sup.stop_replica(old, timeout=15)
    summary = {
        "ok": True,
        "endpoint": req.endpoint,
        "new": new.name,
        "from_pool": source.name,
        "to_pool": target.name,
        "drain_s": round(drain_s, 3),
        "exit_code": code,
        "seconds": round(time.monotonic() - t_start, 3),
    }
    await say("finished", **{k: v for k, v in summary.items() if k not in ("endpoint", "to_pool")})
    return summary
