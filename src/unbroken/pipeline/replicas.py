"""The engine replicas of a local pipeline: what runs one (argv, environment), and its life.

A replica is started in its own session (at the pool's startup nice value, and under a
startup CPU quota when others already serve, both lifted once it serves), waited on until
`/health` answers (stage 1), registered with the gateway (which warms it up: stage 2) and
watched: one that dies is replaced, with backoff, until a successor serves. `ReplicaSet`
keeps them by name; the supervisor exposes that dict as `Supervisor.replicas`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

from unbroken.clients import AdminError
from unbroken.config.spec import LIVENESS_FAILURES, PipelineSpec, PoolSpec
from unbroken.pipeline.cpucap import CpuCap, CpuCapUnavailable
from unbroken.pipeline.niceness import may_renice, set_session_nice
from unbroken.pipeline.procs import Proc, StartupError, backoff, first_line, tail, terminate
from unbroken.wire.http import free_port, wait_ok

if TYPE_CHECKING:
    from unbroken.pipeline.supervisor import Supervisor

__all__ = [
    "STOP_MARGIN_S",
    "HealthTimeout",
    "Replica",
    "ReplicaSet",
    "engine_argv",
    "key_var",
    "pool_key",
    "serial_of",
    "stop_timeout",
]

log = logging.getLogger("unbroken.pipeline")


# While a replica starts, a line this often says that its start is still awaited.
HEALTH_LOG_EVERY_S = 10.0
# At a stop, what an engine gets beyond its pool's `engine.shutdown_timeout_s` (the time it
# announces for its in-flight requests) before SIGKILL: its own exit after the drain.
STOP_MARGIN_S = 5.0


# The liveness check of a replica that has served (config.spec: LIVENESS_*, the pool's
# `engine.liveness_period_s`): killed and replaced as a crashed one is after
# LIVENESS_FAILURES failures in a row. The numbers of the livenessProbe `unbroken render k8s`
# gives engines (k8s/manifests.py; a test holds them equal), so a hung engine heals the same
# way under `unbroken up` as on a cluster. A slow /health under load is not a failure below
# the timeout, and a replica still starting is never checked (its start has its own timeout).


def stop_timeout(pool: PoolSpec) -> float:
    """How long a stop waits for a replica of `pool` before SIGKILL."""
    return pool.engine.shutdown_timeout_s + STOP_MARGIN_S


class HealthTimeout(StartupError):
    """A replica did not answer /health within its pool's `engine.health_timeout_s`."""


@dataclass(eq=False)
class Replica:
    name: str
    pool: PoolSpec
    port: int
    host: str = "127.0.0.1"
    proc: Proc | None = None
    log_path: Path | None = None
    argv: list[str] = field(default_factory=list)
    started_at: float = field(default_factory=time.time)
    healthy_at: float | None = None
    niced: bool = False  # started at the pool's startup_nice, not yet back to 0
    cpucap: CpuCap | None = None  # the startup CPU quota, until it serves (cpucap.py)
    unidle: asyncio.TimerHandle | None = None  # ends the quota's idle-only phase
    stopping: bool = False
    health_failures: int = 0  # liveness checks failed in a row (0: it answers /health)
    killed_why: str | None = None  # why the supervisor killed it (the liveness check)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    @property
    def serving(self) -> bool:
        """Alive and past /health: a replica still starting (a replacement's next try, a
        rollout's surge) is not one of the pool's live replicas yet."""
        return self.alive and self.healthy_at is not None

    @property
    def live(self) -> bool:
        """Serving and answering /health (its last liveness check passed): what a pool's
        `live` counts; a hung engine (SIGSTOP, a deadlock) is alive but not live."""
        return self.serving and self.health_failures == 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "pool": self.pool.name,
            "url": self.url,
            "pid": self.pid,
            "precision": self.pool.precision,
            "started_at": self.started_at,
            "start_to_health_s": None
            if self.healthy_at is None
            else round(self.healthy_at - self.started_at, 3),
            "alive": self.alive,
            "state": "starting"
            if not self.serving
            else "serving"
            if self.live
            else "not answering",
            "health_failures": self.health_failures,
        }


def pool_key(pool: PoolSpec) -> str | None:
    """The pool's upstream API key, from the spec or the environment variable it names."""
    if pool.api_key:
        return pool.api_key
    if pool.api_key_env:
        return os.environ.get(pool.api_key_env) or None
    return None


def key_var(pool: str) -> str:
    """The variable that carries a pool's upstream key to the gateway (never its settings)."""
    return "UNBROKEN_POOL_KEY_" + pool.upper().replace("-", "_")


def serial_of(name: str, pool: str) -> int | None:
    """N of a replica named POOL-N (None for another pool's or another scheme's name)."""
    head, _, n = name.rpartition("-")
    return int(n) if head == pool and n.isdigit() else None


def engine_argv(
    spec: PipelineSpec, pool: PoolSpec, host: str, port: int, weights: Path | None
) -> list[str]:
    """The command line of one replica of `pool`: the pool's own command (vLLM given the
    pool's other names and adapters unless the command has them), or the simulator."""
    e = pool.engine
    model = pool.model_of(spec)
    lora = pool.lora_modules(spec)
    if e.kind == "command":
        assert e.command is not None
        subst = {"port": str(port), "host": host, "model": model}
        argv = [part.format(**subst) for part in e.command]
        if any("vllm" in part for part in argv[:3]):
            if pool.aliases and "--served-model-name" not in argv:
                argv += ["--served-model-name", model, *pool.aliases]
            if lora and "--lora-modules" not in argv:
                argv += ["--enable-lora", "--max-loras", str(len(lora))]
                argv += ["--lora-modules", *lora]
        return argv
    argv = [
        *[sys.executable, "-m", "unbroken", "engine", "--host", host, "--port", str(port)],
        *["--served-model-name", model, *pool.aliases],
        *["--profile", e.profile, "--seed", str(e.seed), "--eos-rate", str(e.eos_rate)],
        *["--shutdown-timeout", str(e.shutdown_timeout_s), *e.overrides.args()],
    ]
    if lora:
        argv += ["--enable-lora", "--max-loras", str(len(lora)), "--lora-modules", *lora]
    if weights is not None:
        argv += ["--weights", str(weights)]
    return argv


class ReplicaSet:
    """Every replica of the pipeline by name, and what starts, watches, replaces and stops
    them. The supervisor (`sup`) lends the spec, the gateway's admin API, the event log, the
    plane record and the task set."""

    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup
        self.by_name: dict[str, Replica] = {}
        self.replacing: dict[str, str] = {}  # pool replica being replaced → last failure
        self._serial = {p.name: itertools.count(1) for p in sup.spec.pools}
        self._cap_unavailable = False  # said once: no cgroup CPU quota here
        # Names given in this state directory before (their logs stay): never again, so a
        # name is one process's in the logs and in the gateway's metric labels (a review as
        # an SRE found a new fallback-1 appending to an earlier supervisor's fallback-1.log).
        for log in sup.logs.glob("*.log") if sup.logs.is_dir() else ():
            for p in sup.spec.pools:
                self.keep_serials_above(log.stem, p.name)

    def of_pool(self, pool: str) -> list[Replica]:
        """The pool's replicas that are not being stopped, oldest first."""
        return [
            r
            for r in sorted(self.by_name.values(), key=lambda r: r.started_at)
            if r.pool.name == pool and not r.stopping
        ]

    def serving(self, pool: str) -> int:
        """The pool's live replicas: serving and answering /health."""
        return sum(1 for r in self.of_pool(pool) if r.live)

    def engine_argv(self, pool: PoolSpec, host: str, port: int) -> list[str]:
        return engine_argv(self.sup.spec, pool, host, port, self.sup.weights.weights_for(pool))

    def keep_serials_above(self, name: str, pool: str) -> None:
        """An adopted replica's name is never given again to a new one."""
        if (n := serial_of(name, pool)) is not None:
            self._serial[pool] = itertools.count(max(n + 1, next(self._serial[pool])))

    async def start(self, pool: PoolSpec) -> Replica:
        sup = self.sup
        name = f"{pool.name}-{next(self._serial[pool.name])}"
        port = free_port()
        r = Replica(name=name, pool=pool, port=port)
        # The engines' own admin token, never the gateway's; vLLM reads its API key from
        # VLLM_API_KEY.
        env = {"UNBROKEN_ADMIN_TOKEN": sup.engine_token or "", **pool.engine.env}
        if (key := pool_key(pool)) is not None:
            env.setdefault("VLLM_API_KEY", key)
        r.argv = self.engine_argv(pool, r.host, port)
        r.proc, r.log_path = await sup.spawn(name, r.argv, env)
        r.started_at = time.time()
        sup.weights.reads(r.proc.pid)
        if pool.engine.startup_nice and may_renice():
            # The whole session spawn made (niceness.py: its process group and its
            # autogroup): engines that fork workers while starting (vLLM's engine core) are
            # lowered and raised with it.
            with contextlib.suppress(OSError):
                set_session_nice(r.proc.pid, pool.engine.startup_nice)
                r.niced = True
        self._cap_start(r)
        self.by_name[name] = r
        sup.save_plane()
        log.info("started %s (pid %d, port %d)", name, r.pid, port)
        sup.record("replica_started", replica=name, pid=r.pid)
        return r

    async def wait_health(self, r: Replica, *, timeout: float | None = None) -> None:
        """Until `r` answers /health: StartupError if it exits first, HealthTimeout after
        `timeout` (None: the pool's `engine.health_timeout_s`). A line every
        HEALTH_LOG_EVERY_S says it still waits (a large model loads for minutes, and
        without a terminal `unbroken up` shows no spinner)."""
        limit = timeout or r.pool.engine.health_timeout_s

        def alive() -> None:
            if r.proc is not None and r.proc.returncode is not None:
                raise StartupError(
                    f"{r.name} exited with {r.proc.returncode} before "
                    f"answering /health; log: {r.log_path}\n" + tail(r.log_path)
                )

        async def say_waiting() -> None:
            t0 = time.monotonic()
            while True:
                await asyncio.sleep(HEALTH_LOG_EVERY_S)
                log.info(
                    "waiting for %s to answer /health: %.0f s of %g (pid %s, log: %s)",
                    r.name,
                    time.monotonic() - t0,
                    limit,
                    r.pid,
                    r.log_path,
                )

        ticker = asyncio.create_task(say_waiting())
        try:
            async with aiohttp.ClientSession() as s:
                await wait_ok(s, r.url + "/health", timeout=limit, check=alive)
        except TimeoutError:
            raise HealthTimeout(
                f"{r.name} did not answer /health within {limit:g} s (the pool's "
                f"engine.health_timeout_s); log: {r.log_path}"
            ) from None
        finally:
            ticker.cancel()
        r.healthy_at = time.time()
        self.sup.save_plane()
        if r.niced and r.proc is not None:  # serving from here on: its fair share again
            with contextlib.suppress(OSError):
                set_session_nice(r.proc.pid, 0)
            r.niced = False
        self._uncap(r, serves=True)

    def _cap_start(self, r: Replica) -> None:
        """The startup CPU quota, for a replica that starts beside serving ones (a first
        `up` starts with nothing to protect, at full speed). Not for one whose model no
        serving replica serves (its only replica was killed): its model's requests all wait
        for it, so it starts at full speed rather than yield to other models' replicas
        (measured: 11 s to replace the only replica of a model under the quota on a busy
        machine, ~1.6 s without; a helper's review)."""
        cores = r.pool.engine.startup_cpu
        if not cores or r.proc is None or self._cap_unavailable:
            return
        spec = self.sup.spec
        names = set(r.pool.served_names(spec))
        if not any(
            o.serving and names & set(o.pool.served_names(spec))
            for o in self.by_name.values()
            if o is not r
        ):
            return
        try:
            cap = CpuCap.create(f"unbroken-start-{os.getpid()}-{r.name}", cores)
        except CpuCapUnavailable as e:
            self._cap_unavailable = True
            log.warning("no startup CPU quota for starting replicas: %s", e)
            return
        try:
            cap.add(r.proc.pid)
        except OSError as e:  # exited already
            log.warning("startup CPU quota for %s: %s", r.name, e)
            cap.release()
            return
        r.cpucap = cap
        idle_s = r.pool.engine.startup_idle_s
        idle = bool(idle_s) and cap.idle()
        if idle:
            # After `idle_s`, a normal share again under the quota: a saturated node would
            # otherwise barely start it. Lifted with the quota if it serves sooner.
            r.unidle = asyncio.get_running_loop().call_later(idle_s, self._unidle, r)
        log.info(
            "%s starts under a CPU quota of %s%s",
            r.name,
            cap.describe(),
            f", on idle CPU only for up to {idle_s:g} s" if idle else "",
        )

    def _unidle(self, r: Replica) -> None:
        r.unidle = None  # `_uncap` cancels this timer, so the quota is still there
        if r.cpucap is not None and r.cpucap.idle(False):
            log.info(
                "%s: still starting after %g s: CPU share back to normal under its quota",
                r.name,
                r.pool.engine.startup_idle_s,
            )

    def _uncap(self, r: Replica, *, serves: bool = False) -> None:
        """Remove `r`'s startup CPU quota: it serves (`serves`), or it is stopped or died
        before it did (said so: "serves" was logged for replicas that never served)."""
        if r.unidle is not None:
            r.unidle.cancel()
            r.unidle = None
        cap, r.cpucap = r.cpucap, None
        if cap is None:
            return
        held = cap.throttled_s()
        try:
            cap.release()
        except OSError as e:
            log.warning("could not lift %s's startup CPU quota: %s", r.name, e)
            return
        if serves:
            log.info("%s serves: CPU quota lifted (held back %.2f s while starting)", r.name, held)
        else:
            log.info(
                "%s stopped before serving: its startup CPU quota removed (held back %.2f s)",
                r.name,
                held,
            )

    async def register(self, r: Replica) -> None:
        await self.sup.admin.add(url=r.url, name=r.name, pool=r.pool.name, cap=r.pool.cap)

    async def bring_up(self, pool: PoolSpec) -> Replica:
        """Start, stage 1, register, watch. A replica that fails on the way is stopped and
        forgotten (never left behind as a dead entry)."""
        r = await self.start(pool)
        try:
            await self.wait_health(r)
            await self.register(r)
        except BaseException:
            with contextlib.suppress(Exception):
                await self.stop(r, timeout=5)
            raise
        self.watch(r)
        return r

    def watch(self, r: Replica) -> None:
        """From now on, replace `r` if it dies or stops answering /health (unless it is
        being stopped)."""
        self.sup.track(asyncio.create_task(self._on_exit(r), name=f"watch-{r.name}"))
        self.sup.track(asyncio.create_task(self._liveness(r), name=f"liveness-{r.name}"))

    async def _liveness(self, r: Replica) -> None:
        """The livenessProbe's check (config.spec's LIVENESS_*): a replica that has served and
        then fails /health LIVENESS_FAILURES times in a row is hung; it is killed, and `_on_exit`
        replaces it as a crashed one."""
        period, limit = r.pool.engine.liveness_period_s, r.pool.engine.liveness_timeout_s
        timeout = aiohttp.ClientTimeout(total=limit)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            while True:
                await asyncio.sleep(period)
                if self.sup.closing or r.stopping or not r.alive:
                    return
                if r.healthy_at is None:
                    continue  # still starting: its start has its own timeout
                try:
                    async with s.get(r.url + "/health") as resp:
                        ok, why = resp.status == 200, f"/health answered {resp.status}"
                except TimeoutError:
                    ok, why = False, f"/health did not answer within {limit:g} s"
                except aiohttp.ClientError as e:
                    ok, why = False, f"/health: {type(e).__name__}"
                if ok:
                    if r.health_failures:
                        log.info("%s answers /health again", r.name)
                    r.health_failures = 0
                    continue
                r.health_failures += 1
                if r.health_failures < LIVENESS_FAILURES:
                    log.info(
                        "%s liveness check failed (%d of %d): %s",
                        r.name,
                        r.health_failures,
                        LIVENESS_FAILURES,
                        why,
                    )
                    continue
                if self.sup.closing or r.stopping or not r.alive:
                    return
                r.killed_why = (
                    f"failed its liveness check {r.health_failures} times in a row, "
                    f"every {period:g} s ({why})"
                )
                log.warning("%s (pid %s) %s: killing it", r.name, r.pid, r.killed_why)
                self.sup.record("replica_hung", replica=r.name, pid=r.pid, reason=why)
                self._kill(r)
                return

    @staticmethod
    def _kill(r: Replica) -> None:
        """SIGKILL a hung replica: its whole session when it is our child (an engine's
        workers too; its pid is its session's and cannot be reused before we reap it), else
        the adopted process through its pidfd."""
        assert r.proc is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if isinstance(r.proc, asyncio.subprocess.Process):
                os.killpg(r.proc.pid, signal.SIGKILL)
            else:
                r.proc.kill()

    async def _on_exit(self, r: Replica) -> None:
        sup = self.sup
        assert r.proc is not None
        code = await r.proc.wait()
        if sup.closing or r.stopping:
            return
        if r.killed_why:
            log.warning("%s (pid %s) killed (exit %s): it %s", r.name, r.pid, code, r.killed_why)
        else:
            log.warning("%s (pid %s) exited unexpectedly with %s", r.name, r.pid, code)
        sup.record("replica_died", replica=r.name, pid=r.pid, code=code, reason=r.killed_why)
        self.by_name.pop(r.name, None)
        sup.save_plane()
        with contextlib.suppress(AdminError):
            await sup.admin.remove(name=r.name)
        if not sup.restart:
            return
        await self.replace(r)

    async def replace(self, r: Replica) -> None:
        """Bring up a successor of `r`, retrying with backoff until one serves (the pool
        stays at its declared size in the end, whatever failed on the way)."""
        sup = self.sup
        attempt = 0
        self.replacing[r.name] = "starting"
        try:
            while not sup.closing:
                attempt += 1
                sup.replacements += 1
                pool = sup.pool_spec(r.pool.name) or r.pool  # a rollout may have changed it
                try:
                    new = await self.bring_up(pool)
                except (StartupError, AdminError, OSError) as e:
                    sup.replacements_failed += 1
                    delay = backoff(attempt)
                    why = first_line(e)
                    self.replacing[r.name] = why
                    log.error(
                        "could not replace %s (attempt %d): %s; retrying in %.0f s",
                        r.name,
                        attempt,
                        why,
                        delay,
                    )
                    sup.record(
                        "replace_failed", replica=r.name, attempt=attempt, error=why, retry_s=delay
                    )
                    await asyncio.sleep(delay)
                    continue
                sup.record("replica_replaced", replica=r.name, by=new.name, pid=new.pid)
                log.info("%s replaced by %s", r.name, new.name)
                return
        finally:
            self.replacing.pop(r.name, None)

    async def stop(self, r: Replica, *, timeout: float = 30.0) -> int | None:
        """SIGTERM (the engine finishes its requests), SIGKILL after `timeout`."""
        r.stopping = True
        if r.proc is None or r.proc.returncode is not None:
            self._uncap(r)  # an engine that died while starting leaves its cgroup otherwise
            return r.proc.returncode if r.proc else None
        try:
            return await terminate(r.proc, timeout, r.name)
        finally:
            self._uncap(r)
            self.by_name.pop(r.name, None)
            self.sup.save_plane()
