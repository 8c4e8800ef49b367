"""`unbroken drain REPLICA` under `unbroken up`: the supervisor drains one of its replicas
and replaces it, so the pool keeps its declared size.

Before, `unbroken drain` went to the gateway alone: the gateway let the endpoint go, but the
supervisor kept its engine running outside the gateway, never replaced it (it had not died)
and never registered it again, and nothing undid it (`status`: `unregistered`, declared 2
and live 2 while the gateway had one). Under a supervisor a drain now means what a preStop
drain means on Kubernetes, where the ReplicaSet then replaces the pod: the replica leaves
through the drain path (no new requests, its streams finish or are migrated at the
deadline), it is stopped, and a successor of the same pool is brought up meanwhile (start,
`/health`, registered, warmed up by the gateway). A replica the gateway no longer lists (one
drained through the admin API directly) is simply stopped and replaced the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from unbroken.clients import AdminError, AdminRejected
from unbroken.pipeline.procs import StartupError, first_line
from unbroken.pipeline.rollout import Progress

if TYPE_CHECKING:
    from unbroken.pipeline.replicas import Replica
    from unbroken.pipeline.supervisor import Supervisor

__all__ = ["DrainRequest", "NoSuchReplica", "run_drain"]

log = logging.getLogger("unbroken.pipeline")


class NoSuchReplica(LookupError):
    """Not a replica this supervisor runs (an endpoint added by hand: the gateway's own)."""


class DrainRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    replica: str = Field(min_length=1, max_length=200)
    # None: the gateway's drain_deadline_s.
    deadline_s: float | None = Field(default=None, ge=0)
    # How long to wait for the gateway to let it go before removing it anyway.
    timeout_s: float = Field(default=600.0, gt=0)


async def run_drain(sup: Supervisor, req: DrainRequest, progress: Progress) -> dict[str, Any]:
    r: Replica | None = sup.replicas.get(req.replica)
    if r is None or r.stopping:
        raise NoSuchReplica(req.replica)
    pool = sup.pool_spec(r.pool.name) or r.pool
    t0 = time.monotonic()

    async def say(kind: str, **data: Any) -> None:
        sup.record(f"drain_{kind}", replica=r.name, **data)
        await progress({"event": kind, "t": time.time(), **data})

    inflight: int | None = None
    registered = True
    try:
        ep = await sup.admin.drain(name=r.name, deadline_s=req.deadline_s)
        inflight = int(ep.get("inflight", 0))
    except AdminRejected as e:
        if e.status != 404:
            raise
        registered = False  # drained already (the admin API), or never registered
    await say("started", inflight=inflight, registered=registered, pool=pool.name)
    # The successor starts now: the pool is back at its size as soon as it can be.
    successor = asyncio.create_task(sup.bring_up(pool), name=f"succeed-{r.name}")
    drained = not registered
    if registered:
        deadline = time.monotonic() + req.timeout_s
        while time.monotonic() < deadline and r.alive:
            try:
                if r.name not in {e["name"] for e in await sup.admin.endpoints()}:
                    drained = True
                    break
            except AdminError:
                pass
            await asyncio.sleep(0.1)
        if not drained:
            with contextlib.suppress(AdminError):
                await sup.admin.remove(name=r.name)
    drain_s = round(time.monotonic() - t0, 3)
    code = await sup.stop_replica(r, timeout=15)
    await say("stopped", drain_s=drain_s, exit_code=code, drained=drained)
    summary: dict[str, Any] = {
        "ok": True,
        "replica": r.name,
        "pool": pool.name,
        "inflight": inflight,
        "registered": registered,
        "drained": drained,
        "drain_s": drain_s,
        "exit_code": code,
        "replaced_by": None,
    }
    try:
        new = await successor
    except (StartupError, AdminError, OSError) as e:
        why = first_line(e)
        summary["replace_error"] = why
        log.error("could not bring up a successor of %s: %s; retrying", r.name, why)
        # The replacement path (replicas.py) retries with backoff until one serves.
        sup.track(asyncio.create_task(sup.replica_set.replace(r), name=f"replace-{r.name}"))
    else:
        summary["replaced_by"] = new.name
        sup.record("replica_replaced", replica=r.name, by=new.name, pid=new.pid)
        log.info("%s drained (%.1f s) and replaced by %s", r.name, drain_s, new.name)
    summary["seconds"] = round(time.monotonic() - t0, 3)
    await say("finished", **{k: v for k, v in summary.items() if k not in ("replica", "pool")})
    return summary
