"""The data plane's record (STATE/plane.json) and its adoption by the next supervisor.

The data plane outlives its supervisor (`survive=True`, what `unbroken up` runs): the
processes carry no parent-death signal, and plane.json records each one (pid, start time,
argv, port). A supervisor killed with SIGKILL leaves the gateway and engines serving; the next
`unbroken up` on the directory adopts every recorded process that is still the process
recorded (`procs.Adopted`: same start time and argv, held by a pidfd so a reused pid can never
be signalled) and replaces what is gone. `unbroken down` without a supervisor stops what is
recorded (`stop_plane`). A clean stop removes plane.json.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unbroken.clients import AdminError
from unbroken.pipeline.gateway_proc import STOP_S as GATEWAY_STOP_S
from unbroken.pipeline.procs import Adopted, proc_record, terminate
from unbroken.pipeline.replicas import Replica, stop_timeout

if TYPE_CHECKING:
    from unbroken.pipeline.supervisor import Supervisor

__all__ = ["PLANE_FILE", "adopt_plane", "live_plane", "plane_of", "read_plane", "stop_plane"]

log = logging.getLogger("unbroken.pipeline")

PLANE_FILE = "plane.json"


def read_plane(state: Path) -> dict[str, Any] | None:
    """STATE/plane.json as recorded, or None."""
    try:
        plane = json.loads((state / PLANE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return plane if isinstance(plane, dict) else None


def _records(plane: dict[str, Any]) -> list[dict[str, Any]]:
    gw = plane.get("gateway")
    return [*([gw] if gw else []), *plane.get("replicas", []), *plane.get("companions", [])]


def live_plane(state: Path) -> dict[str, Any] | None:
    """The recorded data plane, each entry with `alive` (still the process recorded); None
    when nothing was recorded."""
    plane = read_plane(state)
    if plane is None:
        return None
    for rec in _records(plane):
        proc = Adopted.verify(rec)
        rec["alive"] = proc is not None
        if proc is not None:
            proc.release()
    return plane


async def stop_plane(state: Path, timeout: float = 15.0) -> list[int]:
    """Stop an orphaned data plane (no supervisor): SIGTERM every recorded process that is
    still the one recorded, in the supervisor's order (companions, then the gateway, which
    drains its streams, then the engines), SIGKILL each after its wait (the gateway's
    STOP_S, an engine's recorded `stop_s`, else `timeout`); remove plane.json. The pids
    stopped."""
    plane = read_plane(state)
    if plane is None:
        return []
    gw = plane.get("gateway")
    waves = [plane.get("companions", []), [gw] if gw else [], plane.get("replicas", [])]
    stopped: list[int] = []
    for n, wave in enumerate(waves):
        procs = [(r, p) for r, p in ((r, Adopted.verify(r)) for r in wave) if p is not None]
        await asyncio.gather(
            *(
                terminate(p, GATEWAY_STOP_S if n == 1 else float(r.get("stop_s") or timeout))
                for r, p in procs
            )
        )
        stopped += [p.pid for _, p in procs]
    with contextlib.suppress(FileNotFoundError):
        (state / PLANE_FILE).unlink()
    return stopped


def plane_of(sup: Supervisor) -> dict[str, Any]:
    """What plane.json records of a running pipeline: every process still alive."""
    gw = sup.gateway.proc
    return {
        "gateway": None
        if gw is None or gw.returncode is not None
        else {
            **proc_record(gw, sup.gateway.argv),
            "url": sup.gateway_url,
            "admin_url": sup.admin_url,
        },
        "replicas": [
            {
                **proc_record(r.proc, r.argv),
                "name": r.name,
                "pool": r.pool.name,
                "host": r.host,
                "port": r.port,
                "started_at": r.started_at,
                "healthy_at": r.healthy_at,
                "stop_s": stop_timeout(r.pool),  # for `unbroken down` without a supervisor
            }
            for r in sup.replicas.values()
            if r.proc is not None and r.proc.returncode is None
        ],
        "companions": [
            {**proc_record(c.proc, c.argv), "name": c.name}
            for c in sup.companions.items.values()
            if c.proc is not None and c.proc.returncode is None
        ],
    }


def write_plane(state: Path, plane: dict[str, Any]) -> None:
    """STATE/plane.json, atomically (a reader never sees half of it)."""
    tmp = state / f".{PLANE_FILE}.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(plane, f, indent=1)
    os.replace(tmp, state / PLANE_FILE)


async def _refusal(sup: Supervisor, gw: Adopted | None, gw_rec: dict[str, Any]) -> str:
    """Why the recorded gateway cannot be adopted ("" when it can): gone, listening where the
    spec no longer says, or not taking our admin token."""
    if gw is None:
        return "no gateway left"
    if (gw_rec.get("url"), gw_rec.get("admin_url")) != (sup.gateway_url, sup.admin_url):
        return f"the gateway listens at {gw_rec.get('url')}, the spec says {sup.gateway_url}"
    try:
        await sup.admin.status()
    except AdminError as e:
        return f"its gateway's admin API: {e}"
    return ""


async def adopt_plane(sup: Supervisor, say: Callable[[str], None]) -> bool:
    """Take back the data plane a supervisor that died left serving: the gateway (if it
    still listens where the spec says and takes our admin token) and every engine that is
    still the process recorded; orphaned companions are stopped (they are started again).
    True when the gateway was adopted; otherwise whatever is left is stopped."""
    plane = read_plane(sup.state)
    if plane is None:
        return False
    gw_rec = plane.get("gateway") or {}
    gw = Adopted.verify(gw_rec) if gw_rec else None
    why = await _refusal(sup, gw, gw_rec)
    for rec in plane.get("companions", []):  # not needed to serve: started afresh
        if (c := Adopted.verify(rec)) is not None:
            with contextlib.suppress(ProcessLookupError):
                c.terminate()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(c.wait(), 5)
    if why:
        if gw is not None:
            gw.release()  # stop_plane looks again, with its own pidfd
        log.warning("not adopting the data plane left in %s: %s; replacing it", sup.state, why)
        say(f"stopping the data plane a previous supervisor left ({why})")
        await stop_plane(sup.state)
        return False
    assert gw is not None
    sup.gateway.adopt(gw, list(gw_rec["argv"]))
    adopted = await _adopt_replicas(sup, plane.get("replicas", []))
    known = {e["name"] for e in await sup.admin.endpoints()}
    for name in known - set(sup.replicas):  # an engine that died with no supervisor
        with contextlib.suppress(AdminError):
            await sup.admin.remove(name=name)
    for r in list(sup.replicas.values()):
        if r.name not in known:
            await sup.wait_health(r)
            await sup.register(r)
        sup.watch(r)
    for p in list(sup.spec.pools):
        if p.autoscale is not None:  # the autoscaler's count survives the supervisor
            n = len(sup.replicas_of(p.name))
            sup.set_pool(
                p.model_copy(update={"replicas": max(p.autoscale.min, min(p.autoscale.max, n))})
            )
    sup.save_plane()
    sup.record("adopted", gateway_pid=gw.pid, replicas=adopted)
    log.info("adopted the running data plane: gateway pid %d, %s", gw.pid, adopted)
    say(f"adopted the running gateway (pid {gw.pid}) and {len(adopted)} engine(s)")
    return True


async def _adopt_replicas(sup: Supervisor, records: list[dict[str, Any]]) -> list[str]:
    """Every recorded engine still running, as a Replica; one of a pool the spec no longer
    has is drained out like a scale-in. The names adopted."""
    adopted: list[str] = []
    for rec in records:
        proc = Adopted.verify(rec)
        pool = sup.pool_spec(str(rec.get("pool")))
        if proc is None:
            continue
        r = Replica(
            name=rec["name"],
            pool=pool or sup.spec.pools[0],
            port=rec["port"],
            host=rec["host"],
            proc=proc,
            log_path=sup.logs / f"{rec['name']}.log",
            argv=list(rec["argv"]),
            started_at=rec["started_at"],
            healthy_at=rec["healthy_at"],
        )
        sup.replicas[r.name] = r
        if pool is None:
            log.warning("%s belongs to pool %s, not in the spec: stopping it", r.name, rec["pool"])
            with contextlib.suppress(AdminError):
                await sup.admin.drain(name=r.name, deadline_s=10)
            await sup.stop_replica(r, timeout=15)
            continue
        sup.replica_set.keep_serials_above(r.name, pool.name)
        adopted.append(r.name)
    return adopted
