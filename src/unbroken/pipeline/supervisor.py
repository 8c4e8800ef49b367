"""The local supervisor behind `unbroken up`: the implementation of `Backend` (backend.py)
that runs the data plane as processes on this machine.

It runs the gateway and every engine replica as child processes, registers each engine with
the gateway's admin API once `/health` answers (the gateway then warms it up: stage 2), and
replaces a replica that dies. A control API on a Unix socket serves `unbroken status`,
rollouts, conversions, scaling and `unbroken reload`. It holds an exclusive lock on its state
directory for its whole life (one pipeline per directory), keeps that directory private, and
gives the engines their own admin token. A replica that cannot be replaced is retried with
backoff until it can, and so is a gateway that crashes; a gateway that exits 0 was stopped on
purpose, and the pipeline stops with it.

`Supervisor` holds what the parts share (the spec, the gateway's admin client, the event log,
the tasks, the change lock) and assembles them, each in its own module:

- procs.py: child processes (spawn, log tails, backoff, `Adopted` processes);
- replicas.py: the engine replicas (argv, start, health, replace, stop, startup caps);
- weights.py: weight files and their pre-warm;
- gateway_proc.py: the gateway process (settings, argv, start, watch and restart);
- plane.py: the data plane's record (plane.json) and its adoption by the next supervisor;
- reload.py: `unbroken reload` and the spec diff;
- control_api.py: the control socket's server (its client is control.py);
- statelock.py: the state directory's lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from unbroken.clients import AdminError, GatewayAdmin
from unbroken.config.paths import RunInfo, engine_token, ensure_state_dir
from unbroken.config.spec import PipelineSpec, PoolSpec
from unbroken.pipeline import companions, gateway_proc
from unbroken.pipeline.backend import ReplicaHandle
from unbroken.pipeline.companions import Companions
from unbroken.pipeline.control_api import ControlServer
from unbroken.pipeline.cpucap import sweep_stale
from unbroken.pipeline.gateway_proc import GatewayProcess, render_gateway_settings
from unbroken.pipeline.plane import (
    PLANE_FILE,
    adopt_plane,
    live_plane,
    plane_of,
    read_plane,
    stop_plane,
    write_plane,
)
from unbroken.pipeline.procs import (
    BACKOFF_FIRST_S,
    BACKOFF_MAX_S,
    UNKNOWN_EXIT,
    Adopted,
    StartupError,
    proc_start_time,
    spawn,
)
from unbroken.pipeline.reload import (
    GATEWAY_RESTART_KEYS,
    RELOAD_TIMEOUT_S,
    Reloader,
    ReloadError,
    diff,
    flatten,
    not_applied,
)
from unbroken.pipeline.replicas import HealthTimeout, Replica, ReplicaSet, stop_timeout
from unbroken.pipeline.rollout import Progress, RolloutRequest, run_rollout
from unbroken.pipeline.statelock import StateLock
from unbroken.pipeline.weights import PREWARM_NICE, Weights

__all__ = [
    "BACKOFF_FIRST_S",
    "BACKOFF_MAX_S",
    "GATEWAY_RESTART_KEYS",
    "PLANE_FILE",
    "PREWARM_NICE",
    "RELOAD_TIMEOUT_S",
    "UNKNOWN_EXIT",
    "Adopted",
    "ReloadError",
    "Replica",
    "StartupError",
    "Supervisor",
    "live_plane",
    "proc_start_time",
    "read_plane",
    "render_gateway_settings",
    "stop_plane",
]

# The spec diff's helpers under the names they had here before reload.py (tests use them).
_diff, _flatten, _not_applied = diff, flatten, not_applied

log = logging.getLogger("unbroken.pipeline")


def describe_engine(engine: dict[str, Any] | None) -> str:
    """An engine as a rollout shows it: a command engine by its command (a simulator
    profile means nothing there), a simulator by what differs from the defaults."""
    if not engine:
        return "the same engine"
    if engine.get("kind") == "command":
        return "command: " + " ".join(engine.get("command") or [])
    parts = [f"{k} {v}" for k, v in engine.items() if k not in ("kind", "overrides")]
    parts += [f"{k}={v}" for k, v in (engine.get("overrides") or {}).items()]
    return "simulator " + ", ".join(parts) if parts else "the simulator's defaults"


def log_rollout(pool: str, ev: dict[str, Any]) -> None:
    """A rollout's start, rollback and outcome in the supervisor's log (its steps are in
    the caller's output and in `status`' events)."""
    kind = ev.get("event")
    if kind == "started":
        log.info(
            "rollout of %s: replacing %s replica(s) with %s",
            pool,
            ev.get("replicas"),
            describe_engine(ev.get("engine")),
        )
    elif kind == "rollback":
        new = ev.get("new")
        log.warning(
            "rollout of %s: rolling back %s: %s",
            pool,
            new or "(no new replica had started)",
            ev.get("reason"),
        )
    elif kind == "finished":
        log.info("rollout of %s finished in %.1f s", pool, ev.get("seconds", 0.0))
    elif kind == "stopped":
        log.warning(
            "rollout of %s stopped after %.1f s (rolled back): pool at %s of %s replica(s)",
            pool,
            ev.get("seconds", 0.0),
            ev.get("live"),
            ev.get("declared"),
        )


class Supervisor:
    def __init__(
        self,
        spec: PipelineSpec,
        *,
        state: Path,
        token: str,
        token_file: Path,
        restart: bool = True,
        spec_path: Path | None = None,
        reload_spec: Callable[[], PipelineSpec] | None = None,
        survive: bool = False,
    ) -> None:
        """`reload_spec` reads the spec again for `unbroken reload` (SpecError if it no
        longer parses or validates); without it a reload re-applies the running spec (new
        gateway workers with the code on disk, no setting changed). `spec_path` is where it
        reads from (None: the default spec), for messages. `survive`: the data plane
        outlives this process (recorded in plane.json, adopted by the next supervisor);
        otherwise each child gets a parent-death signal (the demo, the baseline). How long a
        replica may take to answer /health is its pool's `engine.health_timeout_s`."""
        self.survive = survive
        self.spec = spec
        self.spec_path = spec_path
        self.reload_spec = reload_spec
        self.state = state
        self.token = token
        self.token_file = token_file
        self.restart = restart
        self.logs = state / "logs"
        g = spec.gateway
        self.gateway_url = f"http://{g.host}:{g.port}"
        self.admin_url = f"http://{g.admin_host}:{g.admin_port}"
        self.admin = GatewayAdmin(self.admin_url, token)
        self.engine_token: str | None = None
        self.gateway_restarts = 0  # the gateway's restarts after it died, every try
        # Replica replacements: attempts to bring up a successor of a dead replica, and how
        # many of them failed (one replacement may take several attempts).
        self.replacements = 0
        self.replacements_failed = 0
        self.events: list[dict[str, Any]] = []
        self.closing = False  # stop() has begun: nothing is replaced or restarted any more
        self.stopped = asyncio.Event()  # set when the pipeline should end (gateway exit 0)
        self.change_lock = asyncio.Lock()  # rollouts, conversions, scaling, reloads: one at a time
        self.resizing: tuple[str, int] | None = None  # the resize under way: (pool, n)
        self._tasks: set[asyncio.Task[Any]] = set()
        # The parts.
        self.statelock = StateLock(state)
        self.weights = Weights()
        self.replica_set = ReplicaSet(self)
        self.gateway = GatewayProcess(self)
        self.reloader = Reloader(self)
        self.control = ControlServer(self, state / "supervisor.sock")
        self.companions = Companions(spec, state, self.admin_url, token)

    # -- shared by the parts -------------------------------------------------------------------
    @property
    def replicas(self) -> dict[str, Replica]:
        """Every replica by name (those starting and stopping too)."""
        return self.replica_set.by_name

    @property
    def weight_readers(self) -> Callable[[int], None] | None:
        """Told the pid of each process that reads weights as it starts (weights.py)."""
        return self.weights.readers

    @weight_readers.setter
    def weight_readers(self, fn: Callable[[int], None] | None) -> None:
        self.weights.readers = fn

    @property
    def busy(self) -> bool:
        """A rollout, conversion, scaling or reload is running."""
        return self.change_lock.locked()

    async def spawn(
        self, name: str, argv: list[str], env: dict[str, str] | None = None
    ) -> tuple[asyncio.subprocess.Process, Path]:
        return await spawn(self.logs, name, argv, env, survive=self.survive)

    async def _spawn_recorded(
        self, name: str, argv: list[str], env: dict[str, str] | None = None
    ) -> tuple[asyncio.subprocess.Process, Path]:
        """spawn for the companions: plane.json is written again once the caller has the
        process (on the next loop turn)."""
        out = await self.spawn(name, argv, env)
        asyncio.get_running_loop().call_soon(self.save_plane)
        return out

    def track(self, t: asyncio.Task[Any]) -> None:
        """A background task of the pipeline, cancelled by stop()."""
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def record(self, kind: str, **data: Any) -> None:
        self.events.append({"t": time.time(), "event": kind, **data})

    def save_plane(self) -> None:
        """Record the data plane in STATE/plane.json (atomically) for the next supervisor."""
        if self.survive and self.statelock.held:
            write_plane(self.state, plane_of(self))

    def pool_spec(self, name: str) -> PoolSpec | None:
        return next((p for p in self.spec.pools if p.name == name), None)

    # -- the Backend (rollout.py, convert.py, scale.py) ------------------------------------------
    def replicas_of(self, pool: str) -> list[ReplicaHandle]:
        return list(self.replica_set.of_pool(pool))

    async def prewarm(self, pool: PoolSpec) -> dict[str, Any] | None:
        return await self.weights.prewarm(pool)

    async def start_replica(self, pool: PoolSpec) -> Replica:
        return await self.replica_set.start(pool)

    async def wait_health(self, r: Replica, *, timeout: float | None = None) -> None:
        try:
            await self.replica_set.wait_health(r, timeout=timeout)
        except HealthTimeout as e:  # the Backend's contract: TimeoutError when it never answers
            raise TimeoutError(str(e)) from None

    def adopt(self, r: ReplicaHandle) -> None:
        assert isinstance(r, Replica)
        self.watch(r)

    async def stop_replica(self, r: Replica, *, timeout: float = 30.0) -> int | None:
        """SIGTERM (the engine finishes its requests), SIGKILL after `timeout`."""
        return await self.replica_set.stop(r, timeout=timeout)

    def set_pool(self, pool: PoolSpec) -> None:
        idx = next(i for i, p in enumerate(self.spec.pools) if p.name == pool.name)
        self.spec.pools[idx] = pool

    # -- replicas and weights, for the parts and the benchmarks --------------------------------
    def weights_for(self, pool: PoolSpec) -> Path | None:
        return self.weights.weights_for(pool)

    def prepare_weights(self, progress: Callable[[str], None] | None = None) -> None:
        self.weights.prepare(self.spec.pools, progress)

    def engine_argv(self, pool: PoolSpec, host: str, port: int) -> list[str]:
        return self.replica_set.engine_argv(pool, host, port)

    async def register(self, r: Replica) -> None:
        await self.replica_set.register(r)

    async def bring_up(self, pool: PoolSpec) -> Replica:
        return await self.replica_set.bring_up(pool)

    def watch(self, r: Replica) -> None:
        self.replica_set.watch(r)

    # -- changes, one at a time (the control API's routes) -------------------------------------
    async def rollout(self, req: RolloutRequest, progress: Progress) -> dict[str, Any]:
        """A rolling upgrade (rollout.py), its start, rollback and outcome logged here."""

        async def logged(ev: dict[str, Any]) -> None:
            log_rollout(req.pool, ev)
            await progress(ev)

        async with self.change_lock:
            try:
                return await run_rollout(self, req, logged)
            except Exception as e:  # refused before any replica changed
                log.warning("rollout of %s refused: %s", req.pool, e)
                raise

    async def convert(self, req: Any, progress: Progress) -> dict[str, Any]:
        """Move one replica to another pool (convert.ConvertRequest)."""
        from unbroken.pipeline.convert import run_convert

        async with self.change_lock:
            return await run_convert(self, req, progress)

    async def scale(self, req: Any, progress: Progress) -> dict[str, Any]:
        """Resize an autoscaled pool (scale.ScaleRequest); `scaling` says so meanwhile."""
        from unbroken.pipeline.scale import run_scale

        async with self.change_lock:
            self.resizing = (req.pool, req.replicas)
            try:
                return await run_scale(self, req, progress)
            finally:
                self.resizing = None
                self.save_plane()

    async def drain(self, req: Any, progress: Progress) -> dict[str, Any]:
        """Drain one replica and replace it (drain.DrainRequest; drain.NoSuchReplica when
        it is not one of ours)."""
        from unbroken.pipeline.drain import run_drain

        async with self.change_lock:
            try:
                return await run_drain(self, req, progress)
            finally:
                self.save_plane()

    async def reload(self, via: str = "unbroken reload") -> dict[str, Any]:
        """`unbroken reload` or SIGHUP (`via`; reload.py); ReloadError when refused or
        failed, logged here (a refused reload left no trace in the log otherwise)."""
        try:
            return await self.reloader.reload()
        except ReloadError as e:
            log.warning("reload (%s) refused, nothing changed: %s", via, e)
            self.record("reload_refused", via=via, error=str(e))
            raise

    async def reload_on_hup(self) -> None:
        """SIGHUP to `unbroken up` (a closed terminal, systemd's `ExecReload=kill -HUP`): a
        reload, as nginx, haproxy and Prometheus do; it killed the supervisor silently."""
        if self.closing:
            return
        log.info("SIGHUP: reloading the spec, as `unbroken reload` does")
        try:
            await self.reload(via="SIGHUP")
        except ReloadError:
            pass  # logged by reload()
        except Exception:
            log.exception("reload (SIGHUP) failed")

    # -- whole pipeline ------------------------------------------------------------------------
    def lock(self) -> None:
        """Take the state directory (StartupError if another pipeline has it)."""
        self.statelock.take()

    def unlock(self) -> None:
        self.statelock.release()

    async def start(self, progress: Callable[[str], None] | None = None) -> None:
        say = progress or (lambda _m: None)
        ensure_state_dir(self.state)
        self.lock()
        self.engine_token = engine_token(self.state)
        if swept := sweep_stale():  # a dead supervisor's starting replicas, now uncapped
            log.info("removed startup CPU quotas left by dead supervisors: %s", ", ".join(swept))
        await asyncio.get_running_loop().run_in_executor(None, self.prepare_weights, say)
        if not await adopt_plane(self, say):
            say("starting the gateway")
            await self.gateway.start()
        missing = [
            p for p in self.spec.pools for _ in range(p.replicas - len(self.replicas_of(p.name)))
        ]
        say(f"starting {len(missing)} engine replica(s)")
        await asyncio.gather(*(self.bring_up(p) for p in missing))
        say("waiting for every endpoint to pass its warm-up")
        await self.wait_ready()
        self.track(asyncio.create_task(self.gateway.watch(), name="watch-gateway"))
        await self.control.start()
        await self.companions.start(self._spawn_recorded, say)
        RunInfo(
            pid=os.getpid(),
            gateway_url=self.gateway_url,
            admin_url=self.admin_url,
            control_socket=str(self.control.socket),
            token_file=str(self.token_file),
            started=time.time(),
        ).write(self.state)

    async def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            eps = {e["name"]: e for e in await self.admin.endpoints()}
            pending = [n for n in self.replicas if eps.get(n, {}).get("state") != "ready"]
            if not pending:
                return
            if time.monotonic() > deadline:
                detail = "; ".join(f"{n}: {eps.get(n, {}).get('last_error')}" for n in pending)
                raise StartupError(f"not ready after {timeout:.0f} s: {detail}")
            await asyncio.sleep(0.1)

    async def status(self) -> dict[str, Any]:
        gw: dict[str, Any] | None
        try:
            gw = await self.admin.status()
        except AdminError as e:
            gw = {"error": str(e)}
        return {
            "pid": os.getpid(),
            "gateway_url": self.gateway_url,
            "admin_url": self.admin_url,
            "gateway_pid": self.gateway.proc.pid if self.gateway.proc else None,
            # A replica that exited is on its way out (replaced or retried): not listed.
            "replicas": [r.as_dict() for r in self.replicas.values() if r.alive],
            "pools": {p.name: self._pool_status(p) for p in self.spec.pools},
            "replacing": dict(self.replica_set.replacing),
            "gateway_restarts": self.gateway_restarts,
            "replacements": {"attempts": self.replacements, "failed": self.replacements_failed},
            "stop_budget_s": round(self.stop_budget_s(), 1),
            "gateway": gw,
            "events": self.events[-50:],
            **await self.companions.status(),
        }

    @property
    def scaling(self) -> str | None:
        """The resize under way as status shows it ("pool -> n"), if any."""
        return None if self.resizing is None else f"{self.resizing[0]} -> {self.resizing[1]}"

    def _pool_status(self, p: PoolSpec) -> dict[str, Any]:
        """A pool in `status`: an autoscaled one also with its range and, while a resize of
        this pool (not another's) is under way, `scaling` ("pool -> n") and `wanted`, the
        size it goes to; else `wanted` is the declared size."""
        out: dict[str, Any] = {"declared": p.replicas, "live": self.replica_set.serving(p.name)}
        if p.autoscale:
            r = self.resizing
            mine = r is not None and r[0] == p.name
            out |= {
                "min": p.autoscale.min,
                "max": p.autoscale.max,
                "scaling": self.scaling if mine else None,
                "wanted": r[1] if r is not None and mine else p.replicas,
            }
        return out

    def pools_summary(self) -> dict[str, Any]:
        """The pools as the autoscaler needs them (GET /pools), without asking the gateway."""
        return {
            "busy": self.busy,
            "scaling": self.scaling,
            "pools": [
                {
                    "name": p.name,
                    "model": p.model_of(self.spec),
                    "precision": p.precision,
                    "declared": p.replicas,
                    "live": self.replica_set.serving(p.name),
                    "autoscale": p.autoscale.model_dump() if p.autoscale else None,
                    "scaling": p.scaling.model_dump(),
                    # The gateway's cap per replica: what a replica holds before the gateway
                    # spills to the next pool (controller/autoscale.py, PoolScaling.cap).
                    "cap": self.spec.pool_cap(p),
                }
                for p in self.spec.pools
            ],
        }

    def stop_budget_s(self) -> float:
        """The longest a stop may take: the companions, the gateway's drain and exit, then
        the slowest pool's engine shutdown timeout (plus margins) before any SIGKILL."""
        engines = max((stop_timeout(p) for p in self.spec.pools), default=0.0)
        return companions.STOP_TIMEOUT_S + gateway_proc.STOP_S + engines

    async def stop(self) -> None:
        """The front end first, then the back ends, as a load balancer's clients expect: the
        gateway stops taking requests, lets its streams finish for gateway_proc.SHUTDOWN_S and
        ends the rest with its `shutdown` event (its upstreams serve meanwhile); then each
        engine gets SIGTERM and its pool's `engine.shutdown_timeout_s` (plus a margin)
        before SIGKILL. Stopping the engines first cut the gateway's streams as broken."""
        self.closing = True
        replicas = list(self.replicas.values())
        log.info(
            "stopping: the gateway drains its streams for up to %g s, then %d engine(s) "
            "finish theirs (their shutdown_timeout_s, up to %g s); at most %.0f s in all",
            gateway_proc.SHUTDOWN_S,
            len(replicas),
            max((r.pool.engine.shutdown_timeout_s for r in replicas), default=0),
            self.stop_budget_s(),
        )
        await self.companions.stop()  # the controller first: it must not react to the stop
        for t in list(self._tasks):
            t.cancel()
        t0 = time.monotonic()
        await self.gateway.stop()
        log.info("the gateway stopped in %.1f s", time.monotonic() - t0)
        t0 = time.monotonic()
        codes = await asyncio.gather(
            *(self.stop_replica(r, timeout=stop_timeout(r.pool)) for r in replicas),
            return_exceptions=True,
        )
        if replicas:
            log.info(
                "engines stopped in %.1f s: %s",
                time.monotonic() - t0,
                ", ".join(f"{r.name} exit {c}" for r, c in zip(replicas, codes, strict=True)),
            )
        await self.control.stop()
        if self.statelock.held:  # run.json is ours only if the directory was
            for name in ("run.json", PLANE_FILE):
                with contextlib.suppress(FileNotFoundError):
                    (self.state / name).unlink()
        await self.admin.close()
        self.unlock()
