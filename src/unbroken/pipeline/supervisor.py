"""The local supervisor behind `unbroken up`.

It runs the gateway and every engine replica as child processes (each in its own session),
registers each engine with
the gateway's admin API once `/health` answers (the gateway then warms it up: stage 2), and
replaces a replica that dies. A small control API on a Unix socket serves `unbroken status`.

It holds an exclusive lock on its state directory for its whole life (one pipeline per
directory), keeps that directory private, and gives the engines their own admin token. A
replica that cannot be replaced is retried with backoff until it can, and so is a gateway
that crashes; a gateway that exits 0 was stopped on purpose, and the pipeline stops with it.

`unbroken reload` (POST /reload on the control socket) re-reads the spec, renders the
gateway's settings again (`render_gateway_settings`, the same as at start), SIGHUPs the
gateway and waits for its new workers; what only a restart can change is listed, not applied.

The data plane outlives its supervisor (`survive=True`, what `unbroken up` runs): the
processes carry no parent-death signal, and STATE/plane.json records each one (pid, start
time, argv, port). A supervisor killed with SIGKILL leaves the gateway and engines serving; the
next `unbroken up` on the directory adopts every recorded process that is still the process
recorded (`Adopted`: same start time and argv, held by a pidfd so a reused pid can never be
signalled) and replaces what is gone. A clean stop removes plane.json.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from unbroken.clients import AdminError, GatewayAdmin
from unbroken.config.paths import (
    RunInfo,
    StateDirBusy,
    cache_dir,
    engine_token,
    ensure_state_dir,
    lock_state_dir,
)
from unbroken.config.spec import GatewaySettings, PipelineSpec, PoolSpec, SpecError
from unbroken.pipeline.backend import ReplicaHandle
from unbroken.pipeline.companions import Companions
from unbroken.pipeline.cpucap import CpuCap, CpuCapUnavailable
from unbroken.pipeline.niceness import may_renice, set_session_nice
from unbroken.pipeline.rollout import RolloutError, RolloutRequest, run_rollout
from unbroken.wire.http import free_port, wait_ok

__all__ = [
    "GATEWAY_RESTART_KEYS",
    "ReloadError",
    "Replica",
    "StartupError",
    "Supervisor",
    "render_gateway_settings",
]

log = logging.getLogger("unbroken.pipeline")

PREWARM_NICE = 10  # the pre-warm yields the CPU to serving engines (it waits on storage)


class StartupError(RuntimeError):
    pass


class ReloadError(RuntimeError):
    """A reload refused or failed; nothing changed. `status` is the control API's answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


# Gateway settings a running gateway keeps until it is restarted: where it listens (the main
# process owns the listening socket and the admin API) and the prober's, which the main
# process reads only at start. A reload reports a change of these as not applied.
GATEWAY_RESTART_KEYS = (
    "host",
    "port",
    "admin_host",
    "admin_port",
    "probe_interval_s",
    "health_fail_threshold",
    "warmup_timeout_s",
)
RELOAD_TIMEOUT_S = 60.0  # the gateway allows each new worker 30 s to serve


# Retry delays for replacing a replica or restarting the gateway: doubling, capped.
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 60.0


def _backoff(attempt: int) -> float:
    return float(min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** max(0, attempt - 1)))


PLANE_FILE = "plane.json"
UNKNOWN_EXIT = -1  # an adopted process is not our child: its exit status cannot be read


def proc_start_time(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat (clock ticks after boot): with the pid, who a process is."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _cmdline(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [a.decode(errors="replace") for a in raw.split(b"\0")[:-1]]


class Adopted:
    """A process an earlier supervisor started (not our child), with the part of
    asyncio.subprocess.Process the supervisor uses. A pidfd pins it: signals go to this
    process or nowhere, and `wait` wakes when it exits (its exit status is UNKNOWN_EXIT)."""

    def __init__(self, pid: int, pidfd: int) -> None:
        self.pid = pid
        self._fd = pidfd
        self._code: int | None = None

    @classmethod
    def verify(cls, rec: dict[str, Any]) -> Adopted | None:
        """The recorded process if it still runs as recorded (start time and argv), else None."""
        pid = rec.get("pid")
        if not isinstance(pid, int) or pid <= 0:
            return None
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return None
        # Checked after the pidfd is open: if the pid was reused before, this sees it.
        if proc_start_time(pid) != rec.get("start") or _cmdline(pid) != rec.get("argv"):
            os.close(fd)
            return None
        return cls(pid, fd)

    @property
    def returncode(self) -> int | None:
        if self._code is None:
            import select

            if select.select([self._fd], [], [], 0)[0]:
                self._exited()
        return self._code

    def _exited(self) -> None:
        if self._code is None:
            self._code = UNKNOWN_EXIT
            os.close(self._fd)

    async def wait(self) -> int:
        while self.returncode is None:
            loop = asyncio.get_running_loop()
            ready = loop.create_future()
            loop.add_reader(self._fd, ready.set_result, None)
            try:
                await ready
            finally:
                loop.remove_reader(self._fd)
        assert self._code is not None
        return self._code

    def send_signal(self, sig: int) -> None:
        if self.returncode is not None:
            raise ProcessLookupError(self.pid)
        signal.pidfd_send_signal(self._fd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def read_plane(state: Path) -> dict[str, Any] | None:
    """STATE/plane.json as recorded, or None."""
    try:
        plane = json.loads((state / PLANE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return plane if isinstance(plane, dict) else None


def live_plane(state: Path) -> dict[str, Any] | None:
    """The recorded data plane, each entry with `alive` (still the process recorded); None
    when nothing was recorded."""
    plane = read_plane(state)
    if plane is None:
        return None
    for rec in _plane_records(plane):
        proc = Adopted.verify(rec)
        rec["alive"] = proc is not None
        if proc is not None:
            os.close(proc._fd)
    return plane


def _plane_records(plane: dict[str, Any]) -> list[dict[str, Any]]:
    gw = plane.get("gateway")
    return [*([gw] if gw else []), *plane.get("replicas", []), *plane.get("companions", [])]


async def stop_plane(state: Path, timeout: float = 15.0) -> list[int]:
    """Stop an orphaned data plane (no supervisor): SIGTERM every recorded process that is
    still the one recorded (engines and companions first, then the gateway), SIGKILL what is
    left after `timeout`; remove plane.json. The pids stopped."""
    plane = read_plane(state)
    if plane is None:
        return []
    gw = plane.get("gateway")
    waves = [[*plane.get("companions", []), *plane.get("replicas", [])], [gw] if gw else []]
    stopped: list[int] = []
    for wave in waves:
        procs = [p for p in (Adopted.verify(r) for r in wave) if p is not None]
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.terminate()

        async def one(p: Adopted) -> None:
            try:
                await asyncio.wait_for(p.wait(), timeout)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                await p.wait()

        await asyncio.gather(*(one(p) for p in procs))
        stopped += [p.pid for p in procs]
    with contextlib.suppress(FileNotFoundError):
        (state / PLANE_FILE).unlink()
    return stopped


def _record(proc: Any, argv: list[str]) -> dict[str, Any]:
    return {"pid": proc.pid, "start": proc_start_time(proc.pid), "argv": argv}


def _die_with_parent() -> None:
    """preexec_fn: the child gets SIGTERM if the supervisor dies, even by SIGKILL."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass(eq=False)
class Replica:
    name: str
    pool: PoolSpec
    port: int
    host: str = "127.0.0.1"
    proc: asyncio.subprocess.Process | Adopted | None = None
    log_path: Path | None = None
    argv: list[str] = field(default_factory=list)
    started_at: float = field(default_factory=time.time)
    healthy_at: float | None = None
    niced: bool = False  # started at the pool's startup_nice, not yet back to 0
    cpucap: CpuCap | None = None  # the startup CPU quota, until it serves (cpucap.py)
    stopping: bool = False

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
            "state": "serving" if self.serving else "starting",
        }


class Supervisor:
    def __init__(
        self,
        spec: PipelineSpec,
        *,
        state: Path,
        token: str,
        token_file: Path,
        health_timeout: float = 120.0,
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
        otherwise each child gets a parent-death signal (the demo, the baseline)."""
        self.survive = survive
        self.spec = spec
        self.spec_path = spec_path
        self.reload_spec = reload_spec
        self.state = state
        self.token = token
        self.token_file = token_file
        self.health_timeout = health_timeout
        self.restart = restart
        self.logs = state / "logs"
        self.replicas: dict[str, Replica] = {}
        self.gateway_proc: asyncio.subprocess.Process | Adopted | None = None
        self.gateway_argv: list[str] = []
        g = spec.gateway
        self.gateway_url = f"http://{g.host}:{g.port}"
        self.admin_url = f"http://{g.admin_host}:{g.admin_port}"
        self.admin = GatewayAdmin(self.admin_url, token)
        self.restarts = 0
        self._serial = {p.name: itertools.count(1) for p in spec.pools}
        self._weights: dict[str, Path] = {}
        self._cap_unavailable = False  # said once: no cgroup CPU quota here
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stopping = False
        self._control: web.AppRunner | None = None
        self.events: list[dict[str, Any]] = []
        self._rollout_lock = asyncio.Lock()  # rollouts, conversions and reloads, one at a time
        self._reloading = False
        self.companions = Companions(spec, state, self.admin_url, token)
        self._lock_fd: int | None = None
        self.engine_token: str | None = None
        self.stopped = asyncio.Event()  # set when the pipeline should end (gateway exit 0)
        self.replacing: dict[str, str] = {}  # pool replica being replaced → last failure
        self.scaling: str | None = None  # the resize under way ("pool -> n"), if any
        # Called with the pid of each process that reads weights (engines, the pre-warm) as
        # it starts: `unbroken demo` puts these, and only these, behind its storage throttle.
        self.weight_readers: Callable[[int], None] | None = None

    # -- processes ----------------------------------------------------------------------------
    async def _spawn(
        self, name: str, argv: list[str], env: dict[str, str] | None = None
    ) -> tuple[asyncio.subprocess.Process, Path]:
        self.logs.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = self.logs / f"{name}.log"
        out = os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab")
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                stdin=asyncio.subprocess.DEVNULL,
                env={**os.environ, **(env or {})},
                start_new_session=True,
                preexec_fn=None if self.survive else _die_with_parent,
            )
        except (FileNotFoundError, PermissionError) as e:
            raise StartupError(f"cannot start {name}: {argv[0]}: {e.strerror}") from None
        finally:
            out.close()
        return proc, path

    async def _spawn_recorded(
        self, name: str, argv: list[str], env: dict[str, str] | None = None
    ) -> tuple[asyncio.subprocess.Process, Path]:
        """_spawn for the companions: plane.json is written again once the caller has the
        process (on the next loop turn)."""
        out = await self._spawn(name, argv, env)
        asyncio.get_running_loop().call_soon(self.save_plane)
        return out

    def _gateway_env(self) -> dict[str, str]:
        env = {"UNBROKEN_ADMIN_TOKEN": self.token}
        for pool in self.spec.pools:
            if (key := _pool_key(pool)) is not None:
                env[_key_var(pool.name)] = key
        return env

    def _write_gateway_config(self, settings: GatewaySettings) -> Path:
        cfg = self.state / "gateway.json"
        fd = os.open(cfg, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(settings.model_dump_json(indent=1))
        os.chmod(cfg, 0o600)  # a file left by an older run may have been 0644
        return cfg

    def _gateway_argv(self) -> list[str]:
        cfg = self._write_gateway_config(render_gateway_settings(self.spec))
        # Workers (at least 2, so that `unbroken reload` can replace them: SIGHUP keeps the
        # main process, and so its pid, which is why a reload never looks like a crash here).
        # The drain fits in the 10 s that stop() waits before SIGKILL.
        workers = max(2, min(len(os.sched_getaffinity(0)), 8))
        return [
            *[sys.executable, "-m", "unbroken", "gateway", "--config", str(cfg)],
            *["--workers", str(workers), "--shutdown-timeout", "8"],
        ]

    def weights_for(self, pool: PoolSpec) -> Path | None:
        if pool.engine.kind != "simulator":
            return pool.weights
        if pool.weights is not None:
            return pool.weights
        return self._weights.get(pool.weights_size)

    def prepare_weights(self, progress: Callable[[str], None] | None = None) -> None:
        """Generate the simulator pools' weight files once; later runs reuse the cache."""
        from unbroken.engine.weights import make_weights, parse_size

        for pool in self.spec.pools:
            if pool.engine.kind != "simulator" or pool.weights is not None:
                continue
            size = pool.weights_size
            d = cache_dir() / "weights" / size.lower()
            if not (d / ".complete").exists():
                if progress:
                    progress(f"generating {size} of weights in {d} (once)")
                make_weights(d, parse_size(size))
                (d / ".complete").write_text("ok\n")
            self._weights[size] = d

    async def prewarm(self, pool: PoolSpec) -> dict[str, Any] | None:
        """Read the pool's weight files into the page cache before a replica starts (the
        engine then loads from memory, not from disk). None when there is nothing to read
        or the pre-warm failed (the replica then reads the disk itself; the rollout goes on).

        It runs as `unbroken prewarm` in a child process at nice PREWARM_NICE: its reader
        threads, in this process, held the GIL against the supervisor's event loop (and,
        in `unbroken demo`, the load generator's, whose clock then measured stalls that no
        engine had), and at normal priority its copies took CPU from the serving engines."""
        weights = self.weights_for(pool)
        if weights is None:
            return None
        argv = [sys.executable, "-m", "unbroken", "prewarm", "--json", str(weights)]
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            stdin=asyncio.subprocess.DEVNULL,
            # Its own session, lowered as a whole (niceness.py): in ours, its nice value
            # ordered it only against the supervisor's own process, and the session as a
            # unit took as much CPU as a serving engine's.
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        with contextlib.suppress(OSError):  # gone already: nothing to lower
            set_session_nice(proc.pid, PREWARM_NICE)
        self._reads_weights(proc.pid)
        try:
            out, err = await proc.communicate()
        except asyncio.CancelledError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise
        try:
            result = json.loads(out)
        except ValueError:
            last = err.decode(errors="replace").strip().splitlines()[-1:]
            log.warning("no pre-warm for %s: %s", pool.name, *(last or [f"exit {proc.returncode}"]))
            return None
        read = result.get("read") or {}
        if proc.returncode != 0:  # read, but not all resident (memory pressure): say so
            log.warning(
                "pre-warm of %s: %.1f %% resident after the read",
                pool.name,
                result.get("residency", {}).get("percent", 0.0),
            )
        return {
            "files": len(result.get("files", [])),
            "bytes": read.get("bytes", 0),
            "seconds": round(read.get("seconds", 0.0), 3),
            "gbps": round(read.get("gbps", 0.0), 2),
        }

    def _reads_weights(self, pid: int) -> None:
        if self.weight_readers is not None:
            try:
                self.weight_readers(pid)
            except OSError as e:  # exited already, or the cgroup is gone
                log.warning("weight reader %d: %s", pid, e)

    def engine_argv(self, pool: PoolSpec, host: str, port: int) -> list[str]:
        e = pool.engine
        model = pool.model_of(self.spec)
        lora = [f"{a.name}={a.path or a.name}" for a in pool.adapters]
        if e.kind == "command":
            assert e.command is not None
            subst = {"port": str(port), "host": host, "model": model}
            argv = [part.format(**subst) for part in e.command]
            if any("vllm" in part for part in argv[:3]):
                # vLLM: the pool's other names and adapters, unless the command gives them.
                if pool.aliases and "--served-model-name" not in argv:
                    argv += ["--served-model-name", model, *pool.aliases]
                if lora and "--lora-modules" not in argv:
                    argv += ["--enable-lora", "--max-loras", str(len(lora))]
                    argv += ["--lora-modules", *lora]
            return argv
        argv = [
            sys.executable,
            "-m",
            "unbroken",
            "engine",
            "--host",
            host,
            "--port",
            str(port),
            "--served-model-name",
            model,
            *pool.aliases,
            "--profile",
            e.profile,
            "--seed",
            str(e.seed),
            "--eos-rate",
            str(e.eos_rate),
            "--shutdown-timeout",
            str(e.shutdown_timeout_s),
            *e.overrides.args(),
        ]
        if lora:
            argv += ["--enable-lora", "--max-loras", str(len(lora)), "--lora-modules", *lora]
        weights = self.weights_for(pool)
        if weights is not None:
            argv += ["--weights", str(weights)]
        return argv

    async def start_replica(self, pool: PoolSpec) -> Replica:
        name = f"{pool.name}-{next(self._serial[pool.name])}"
        port = free_port()
        r = Replica(name=name, pool=pool, port=port)
        # The engines' own admin token, never the gateway's; vLLM reads its API key from
        # VLLM_API_KEY.
        env = {"UNBROKEN_ADMIN_TOKEN": self.engine_token or "", **pool.engine.env}
        if (key := _pool_key(pool)) is not None:
            env.setdefault("VLLM_API_KEY", key)
        r.argv = self.engine_argv(pool, r.host, port)
        r.proc, r.log_path = await self._spawn(name, r.argv, env)
        r.started_at = time.time()
        self._reads_weights(r.proc.pid)
        if pool.engine.startup_nice and may_renice():
            # The whole session _spawn made (niceness.py: its process group and its
            # autogroup): engines that fork workers while starting (vLLM's engine core) are
            # lowered and raised with it.
            with contextlib.suppress(OSError):
                set_session_nice(r.proc.pid, pool.engine.startup_nice)
                r.niced = True
        self._cap_start(r)
        self.replicas[name] = r
        self.save_plane()
        log.info("started %s (pid %d, port %d)", name, r.pid, port)
        self.record("replica_started", replica=name, pid=r.pid)
        return r

    async def wait_health(self, r: Replica) -> None:
        def alive() -> None:
            if r.proc is not None and r.proc.returncode is not None:
                raise StartupError(
                    f"{r.name} exited with {r.proc.returncode} before "
                    f"answering /health; log: {r.log_path}\n" + _tail(r.log_path)
                )

        async with aiohttp.ClientSession() as s:
            try:
                await wait_ok(s, r.url + "/health", timeout=self.health_timeout, check=alive)
            except TimeoutError:
                raise StartupError(
                    f"{r.name} did not answer /health within "
                    f"{self.health_timeout:.0f} s; log: {r.log_path}"
                ) from None
        r.healthy_at = time.time()
        self.save_plane()
        if r.niced and r.proc is not None:  # serving from here on: its fair share again
            with contextlib.suppress(OSError):
                set_session_nice(r.proc.pid, 0)
            r.niced = False
        self._uncap(r)

    def _cap_start(self, r: Replica) -> None:
        """The startup CPU quota, for a replica that starts beside serving ones (a first
        `up` starts with nothing to protect, at full speed)."""
        cores = r.pool.engine.startup_cpu
        if not cores or r.proc is None or self._cap_unavailable:
            return
        if not any(o.serving for o in self.replicas.values() if o is not r):
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
        log.info("%s starts under a CPU quota of %s", r.name, cap.describe())

    def _uncap(self, r: Replica) -> None:
        cap, r.cpucap = r.cpucap, None
        if cap is None:
            return
        held = cap.throttled_s()
        try:
            cap.release()
        except OSError as e:
            log.warning("could not lift %s's startup CPU quota: %s", r.name, e)
            return
        log.info("%s serves: CPU quota lifted (held back %.2f s while starting)", r.name, held)

    async def register(self, r: Replica) -> None:
        await self.admin.add(url=r.url, name=r.name, pool=r.pool.name, cap=r.pool.cap)

    async def bring_up(self, pool: PoolSpec) -> Replica:
        """Start, stage 1, register, watch. A replica that fails on the way is stopped and
        forgotten (never left behind as a dead entry)."""
        r = await self.start_replica(pool)
        try:
            await self.wait_health(r)
            await self.register(r)
        except BaseException:
            with contextlib.suppress(Exception):
                await self.stop_replica(r, timeout=5)
            raise
        self.watch(r)
        return r

    # -- the rollout's Backend ---------------------------------------------------------------
    def replicas_of(self, pool: str) -> list[ReplicaHandle]:
        return [
            r
            for r in sorted(self.replicas.values(), key=lambda r: r.started_at)
            if r.pool.name == pool and not r.stopping
        ]

    def adopt(self, r: ReplicaHandle) -> None:
        assert isinstance(r, Replica)
        self.watch(r)

    def set_pool(self, pool: PoolSpec) -> None:
        idx = next(i for i, p in enumerate(self.spec.pools) if p.name == pool.name)
        self.spec.pools[idx] = pool

    def pool_spec(self, name: str) -> PoolSpec | None:
        return next((p for p in self.spec.pools if p.name == name), None)

    def watch(self, r: Replica) -> None:
        self._track(asyncio.create_task(self._on_exit(r), name=f"watch-{r.name}"))

    async def _on_exit(self, r: Replica) -> None:
        assert r.proc is not None
        code = await r.proc.wait()
        if self._stopping or r.stopping:
            return
        log.warning("%s (pid %s) exited unexpectedly with %s", r.name, r.pid, code)
        self.record("replica_died", replica=r.name, pid=r.pid, code=code)
        self.replicas.pop(r.name, None)
        self.save_plane()
        with contextlib.suppress(AdminError):
            await self.admin.remove(name=r.name)
        if not self.restart:
            return
        await self._replace(r)

    async def _replace(self, r: Replica) -> None:
        """Bring up a successor of `r`, retrying with backoff until one serves (the pool
        stays at its declared size in the end, whatever failed on the way)."""
        attempt = 0
        self.replacing[r.name] = "starting"
        try:
            while not self._stopping:
                attempt += 1
                self.restarts += 1
                pool = self.pool_spec(r.pool.name) or r.pool  # a rollout may have changed it
                try:
                    new = await self.bring_up(pool)
                except (StartupError, AdminError, OSError) as e:
                    delay = _backoff(attempt)
                    why = str(e).splitlines()[0] if str(e) else type(e).__name__
                    self.replacing[r.name] = why
                    log.error(
                        "could not replace %s (attempt %d): %s; retrying in %.0f s",
                        r.name,
                        attempt,
                        why,
                        delay,
                    )
                    self.record(
                        "replace_failed", replica=r.name, attempt=attempt, error=why, retry_s=delay
                    )
                    await asyncio.sleep(delay)
                    continue
                self.record("replica_replaced", replica=r.name, by=new.name, pid=new.pid)
                log.info("%s replaced by %s", r.name, new.name)
                return
        finally:
            self.replacing.pop(r.name, None)

    async def stop_replica(self, r: Replica, *, timeout: float = 30.0) -> int | None:
        """SIGTERM (the engine finishes its requests), SIGKILL after `timeout`."""
        r.stopping = True
        if r.proc is None or r.proc.returncode is not None:
            return r.proc.returncode if r.proc else None
        with contextlib.suppress(ProcessLookupError):
            r.proc.send_signal(signal.SIGTERM)
        try:
            return await asyncio.wait_for(r.proc.wait(), timeout)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                r.proc.kill()
            return await r.proc.wait()
        finally:
            self._uncap(r)
            self.replicas.pop(r.name, None)
            self.save_plane()

    def record(self, kind: str, **data: Any) -> None:
        self.events.append({"t": time.time(), "event": kind, **data})

    # -- whole pipeline ------------------------------------------------------------------------
    def lock(self) -> None:
        """Take the state directory (StartupError if another pipeline has it)."""
        if self._lock_fd is None:
            try:
                self._lock_fd = lock_state_dir(self.state)
            except StateDirBusy as e:
                raise StartupError(str(e)) from None

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    async def start(self, progress: Callable[[str], None] | None = None) -> None:
        say = progress or (lambda _m: None)
        ensure_state_dir(self.state)
        self.lock()
        self.engine_token = engine_token(self.state)
        await asyncio.get_running_loop().run_in_executor(None, self.prepare_weights, say)
        if not await self._adopt_plane(say):
            say("starting the gateway")
            await self._start_gateway()
        missing = [
            p for p in self.spec.pools for _ in range(p.replicas - len(self.replicas_of(p.name)))
        ]
        say(f"starting {len(missing)} engine replica(s)")
        await asyncio.gather(*(self.bring_up(p) for p in missing))
        say("waiting for every endpoint to pass its warm-up")
        await self.wait_ready()
        self._track(asyncio.create_task(self._watch_gateway(), name="watch-gateway"))
        await self._start_control()
        await self.companions.start(self._spawn_recorded, say)
        RunInfo(
            pid=os.getpid(),
            gateway_url=self.gateway_url,
            admin_url=self.admin_url,
            control_socket=str(self.state / "supervisor.sock"),
            token_file=str(self.token_file),
            started=time.time(),
        ).write(self.state)

    async def _start_gateway(self) -> None:
        self.gateway_argv = self._gateway_argv()
        self.gateway_proc, gw_log = await self._spawn(
            "gateway", self.gateway_argv, self._gateway_env()
        )
        self.save_plane()
        await self._wait_gateway(gw_log)

    def save_plane(self) -> None:
        """Record the data plane in STATE/plane.json (atomically) for the next supervisor."""
        if not self.survive or self._lock_fd is None:
            return
        gw = self.gateway_proc
        plane = {
            "gateway": None
            if gw is None or gw.returncode is not None
            else {
                **_record(gw, self.gateway_argv),
                "url": self.gateway_url,
                "admin_url": self.admin_url,
            },
            "replicas": [
                {
                    **_record(r.proc, r.argv),
                    "name": r.name,
                    "pool": r.pool.name,
                    "host": r.host,
                    "port": r.port,
                    "started_at": r.started_at,
                    "healthy_at": r.healthy_at,
                }
                for r in self.replicas.values()
                if r.proc is not None and r.proc.returncode is None
            ],
            "companions": [
                {**_record(c.proc, c.argv), "name": c.name}
                for c in self.companions.items.values()
                if c.proc is not None and c.proc.returncode is None
            ],
        }
        tmp = self.state / f".{PLANE_FILE}.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(plane, f, indent=1)
        os.replace(tmp, self.state / PLANE_FILE)

    async def _adopt_plane(self, say: Callable[[str], None]) -> bool:
        """Take back the data plane a supervisor that died left serving: the gateway (if it
        still listens where the spec says and takes our admin token) and every engine that is
        still the process recorded; orphaned companions are stopped (they are started again).
        True when the gateway was adopted; otherwise whatever is left is stopped."""
        plane = read_plane(self.state)
        if plane is None:
            return False
        gw_rec = plane.get("gateway") or {}
        gw = Adopted.verify(gw_rec) if gw_rec else None
        why = "no gateway left"
        if gw is not None:
            why = ""
            if (gw_rec.get("url"), gw_rec.get("admin_url")) != (self.gateway_url, self.admin_url):
                why = (
                    f"the gateway listens at {gw_rec.get('url')}, the spec says {self.gateway_url}"
                )
            else:
                try:
                    await self.admin.status()
                except AdminError as e:
                    why = f"its gateway's admin API: {e}"
        for rec in plane.get("companions", []):  # not needed to serve: started afresh
            if (c := Adopted.verify(rec)) is not None:
                with contextlib.suppress(ProcessLookupError):
                    c.terminate()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(c.wait(), 5)
        if why:
            log.warning("not adopting the data plane left in %s: %s; replacing it", self.state, why)
            say(f"stopping the data plane a previous supervisor left ({why})")
            await stop_plane(self.state)
            return False
        assert gw is not None
        self.gateway_proc, self.gateway_argv = gw, list(gw_rec["argv"])
        adopted: list[str] = []
        for rec in plane.get("replicas", []):
            proc = Adopted.verify(rec)
            pool = self.pool_spec(str(rec.get("pool")))
            if proc is None:
                continue
            r = Replica(
                name=rec["name"],
                pool=pool or self.spec.pools[0],
                port=rec["port"],
                host=rec["host"],
                proc=proc,
                log_path=self.logs / f"{rec['name']}.log",
                argv=list(rec["argv"]),
                started_at=rec["started_at"],
                healthy_at=rec["healthy_at"],
            )
            self.replicas[r.name] = r
            if pool is None:  # a pool the spec no longer has: drained out like a scale-in
                log.warning(
                    "%s belongs to pool %s, not in the spec: stopping it", r.name, rec["pool"]
                )
                with contextlib.suppress(AdminError):
                    await self.admin.drain(name=r.name, deadline_s=10)
                await self.stop_replica(r, timeout=15)
                continue
            if (n := _serial_of(r.name, pool.name)) is not None:
                self._serial[pool.name] = itertools.count(max(n + 1, next(self._serial[pool.name])))
            adopted.append(r.name)
        known = {e["name"] for e in await self.admin.endpoints()}
        for name in known - set(self.replicas):  # an engine that died with no supervisor
            with contextlib.suppress(AdminError):
                await self.admin.remove(name=name)
        for r in list(self.replicas.values()):
            if r.name not in known:
                await self.wait_health(r)
                await self.register(r)
            self.watch(r)
        for p in list(self.spec.pools):
            if p.autoscale is not None:  # the autoscaler's count survives the supervisor
                n = len(self.replicas_of(p.name))
                self.set_pool(
                    p.model_copy(update={"replicas": max(p.autoscale.min, min(p.autoscale.max, n))})
                )
        self.save_plane()
        self.record("adopted", gateway_pid=gw.pid, replicas=adopted)
        log.info("adopted the running data plane: gateway pid %d, %s", gw.pid, adopted)
        say(f"adopted the running gateway (pid {gw.pid}) and {len(adopted)} engine(s)")
        return True

    def _track(self, t: asyncio.Task[Any]) -> None:
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _watch_gateway(self) -> None:
        """A gateway that dies is restarted on the same ports and given every live engine
        again (its streams are gone with it; new requests are served again in seconds).
        Failed restarts back off; a gateway that exits 0 was stopped on purpose (SIGTERM),
        which ends the pipeline instead."""
        failures = 0
        up_since = time.monotonic()
        while not self._stopping:
            assert self.gateway_proc is not None
            code = await self.gateway_proc.wait()
            if self._stopping:
                return
            pid = self.gateway_proc.pid
            if code == 0 and not isinstance(self.gateway_proc, Adopted):
                log.warning("the gateway (pid %s) stopped (exit 0); stopping the pipeline", pid)
                self.record("gateway_stopped", pid=pid, code=code)
                self.stopped.set()
                return
            if time.monotonic() - up_since > 60:
                failures = 0  # it ran fine for a while: this is a new incident
            log.warning("the gateway (pid %s) exited unexpectedly with %s", pid, code)
            self.record("gateway_died", pid=pid, code=code)
            while not self._stopping:
                if failures:
                    delay = _backoff(failures)
                    log.info("restarting the gateway in %.0f s", delay)
                    await asyncio.sleep(delay)
                self.restarts += 1
                try:
                    await self._start_gateway()
                    for r in list(self.replicas.values()):
                        if r.alive and not r.stopping:
                            await self.register(r)
                    self.record("gateway_restarted", pid=self.gateway_proc.pid)
                    up_since = time.monotonic()
                    failures += 1
                    break
                except (StartupError, AdminError) as e:
                    failures += 1
                    why = str(e).splitlines()[0]
                    log.error("could not restart the gateway: %s", why)
                    self.record("gateway_restart_failed", error=why, attempt=failures)
                    if self.gateway_proc is not None and self.gateway_proc.returncode is None:
                        with contextlib.suppress(ProcessLookupError):
                            self.gateway_proc.kill()
                        await self.gateway_proc.wait()

    async def _wait_gateway(self, gw_log: Path | None = None) -> None:
        gw_log = gw_log or self.logs / "gateway.log"
        deadline = time.monotonic() + 30
        while True:
            assert self.gateway_proc is not None
            if self.gateway_proc.returncode is not None:
                raise StartupError(
                    f"the gateway exited with {self.gateway_proc.returncode}; "
                    f"log: {gw_log}\n" + _tail(gw_log)
                )
            try:
                await self.admin.status()
                return
            except AdminError:
                if time.monotonic() > deadline:
                    raise StartupError(
                        f"the gateway's admin API did not answer at {self.admin_url}; log: {gw_log}"
                    ) from None
                await asyncio.sleep(0.1)

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
            "gateway_pid": self.gateway_proc.pid if self.gateway_proc else None,
            # A replica that exited is on its way out (replaced or retried): not listed.
            "replicas": [r.as_dict() for r in self.replicas.values() if r.alive],
            "pools": {
                p.name: {
                    "declared": p.replicas,
                    "live": sum(1 for r in self.replicas_of(p.name) if r.serving),
                    **(
                        {"min": p.autoscale.min, "max": p.autoscale.max, "scaling": self.scaling}
                        if p.autoscale
                        else {}
                    ),
                }
                for p in self.spec.pools
            },
            "replacing": dict(self.replacing),
            "restarts": self.restarts,
            "gateway": gw,
            "events": self.events[-50:],
            **await self.companions.status(),
        }

    # -- reload --------------------------------------------------------------------------------
    async def reload(self) -> dict[str, Any]:
        """`unbroken reload`: read the spec again, apply its gateway settings (gateway.json
        rendered again, SIGHUP, wait until the new workers serve; routes and pool caps through
        the admin API, which the gateway's main process keeps otherwise) and list what only a
        restart applies. Refused (ReloadError, nothing changed) on a spec that does not
        validate, or when the gateway's new workers do not come up."""
        if self._reloading:
            raise ReloadError(409, "a reload is already under way")
        if self._rollout_lock.locked():
            raise ReloadError(409, "a rollout or conversion is running; reload once it is done")
        self._reloading = True
        try:
            async with self._rollout_lock:  # pool caps must not race a rollout's set_pool
                return await self._reload()
        finally:
            self._reloading = False

    async def _reload(self) -> dict[str, Any]:
        source = str(self.spec_path) if self.spec_path else "the default spec"
        try:
            new = self.reload_spec() if self.reload_spec else self.spec.model_copy(deep=True)
        except SpecError as e:
            raise ReloadError(400, str(e)) from None
        except Exception as e:  # e.g. a file that is not UTF-8
            raise ReloadError(400, f"{source}: {type(e).__name__}: {e}") from None
        running = {p.name for p in self.spec.pools}
        for prio, pools in new.gateway.routes.items():
            if unknown := [p for p in pools if p not in running]:
                raise ReloadError(
                    400,
                    f"{source}: gateway.routes.{prio} names pool(s) this pipeline does not run: "
                    f"{', '.join(unknown)} (a new pool needs a restart of `unbroken up`)",
                )
        old_gw = self.spec.gateway
        # What a running gateway cannot change stays as it is, in gateway.json too: a gateway
        # restarted after a crash must come back on the same ports.
        applied = new.gateway.model_copy(
            update={k: getattr(old_gw, k) for k in GATEWAY_RESTART_KEYS}
        )
        old_r = render_gateway_settings(self.spec)
        new_r = render_gateway_settings(self.spec.model_copy(update={"gateway": applied}))
        changed = _diff(
            _flatten(old_r.model_dump(mode="json"), "gateway."),
            _flatten(new_r.model_dump(mode="json"), "gateway."),
        )
        # A pool's cap is the gateway's in-flight cap per replica: applied too.
        caps: dict[str, int | None] = {}
        for p in self.spec.pools:
            q = next((q for q in new.pools if q.name == p.name), None)
            if q is not None and q.cap != p.cap:
                caps[p.name] = q.cap
                changed.append(_change(f"pools.{p.name}.cap", p.cap, q.cap))
        not_applied = _not_applied(self.spec, new)

        proc = self.gateway_proc
        if proc is None or proc.returncode is not None:
            raise ReloadError(503, "the gateway is not running (being restarted); try again")
        try:
            before = (await self.admin.status()).get("workers", {}).get("generation")
        except AdminError as e:
            raise ReloadError(503, f"the gateway's admin API does not answer: {e}") from None
        if before is None:
            raise ReloadError(500, "the gateway runs a single process: it cannot reload")
        gw_log = self.logs / "gateway.log"
        offset = gw_log.stat().st_size if gw_log.exists() else 0
        self._write_gateway_config(new_r)
        try:
            generation = await self._sighup_and_wait(proc, before, gw_log, offset)
        except ReloadError:
            self._write_gateway_config(old_r)  # nothing changed
            raise

        warnings: list[str] = []
        if old_r.routes != new_r.routes:
            try:
                await self.admin.set_routes(routes={k: list(v) for k, v in new_r.routes.items()})
            except AdminError as e:
                warnings.append(f"gateway.routes not applied: {e}")
        for name, cap in caps.items():
            pool = self.pool_spec(name)
            assert pool is not None
            self.set_pool(pool.model_copy(update={"cap": cap}))
            for r in list(self.replicas.values()):
                if r.pool.name != name:
                    continue
                r.pool = r.pool.model_copy(update={"cap": cap})  # what a re-registration sends
                if r.alive and not r.stopping:
                    try:
                        await self.admin.set_cap(name=r.name, cap=cap)
                    except AdminError as e:
                        warnings.append(f"pools.{name}.cap not applied to {r.name}: {e}")
        self.spec.gateway = applied
        self.record(
            "gateway_reloaded",
            generation=generation,
            changed=[c["key"] for c in changed],
            not_applied=[c["key"] for c in not_applied],
        )
        log.info(
            "gateway reloaded (generation %d): %d setting(s) changed, %d not applied",
            generation,
            len(changed),
            len(not_applied),
        )
        return {
            "ok": True,
            "spec": str(self.spec_path) if self.spec_path else None,
            "gateway_pid": proc.pid,
            "generation": generation,
            "changed": changed,
            "not_applied": not_applied,
            "warnings": warnings,
        }

    async def _sighup_and_wait(
        self, proc: asyncio.subprocess.Process, before: int, gw_log: Path, offset: int
    ) -> int:
        """SIGHUP the gateway and wait until its new generation of workers serves; the
        gateway's own reason (from its log) when it gives up and keeps the old ones."""
        try:
            proc.send_signal(signal.SIGHUP)
        except ProcessLookupError:
            raise ReloadError(503, "the gateway exited; the supervisor restarts it") from None
        deadline = time.monotonic() + RELOAD_TIMEOUT_S
        while True:
            await asyncio.sleep(0.1)
            if proc.returncode is not None:
                raise ReloadError(
                    500, f"the gateway exited ({proc.returncode}) during the reload; log: {gw_log}"
                )
            with contextlib.suppress(AdminError):
                gen = (await self.admin.status()).get("workers", {}).get("generation")
                if isinstance(gen, int) and gen > before:
                    return gen
            if failed := _reload_failure(gw_log, offset):
                raise ReloadError(500, f"the gateway kept its old workers: {failed}; log: {gw_log}")
            if time.monotonic() > deadline:
                raise ReloadError(
                    500,
                    f"the gateway's new workers did not serve within {RELOAD_TIMEOUT_S:.0f} s; "
                    f"log: {gw_log}",
                )

    async def _start_control(self) -> None:
        sock = self.state / "supervisor.sock"
        with contextlib.suppress(FileNotFoundError):
            sock.unlink()

        async def status(request: web.Request) -> web.Response:
            return web.Response(
                text=json.dumps(await self.status()), content_type="application/json"
            )

        async def rollout(request: web.Request) -> web.StreamResponse:
            from pydantic import ValidationError

            try:
                req = RolloutRequest.model_validate_json(await request.read())
            except ValidationError as e:
                return web.json_response({"error": str(e)}, status=400)
            if self._rollout_lock.locked():
                msg = "a rollout, conversion or reload is already running"
                return web.json_response({"error": msg}, status=409)
            resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
            await resp.prepare(request)

            async def progress(ev: dict[str, Any]) -> None:
                with contextlib.suppress(ConnectionError):
                    await resp.write(json.dumps(ev).encode() + b"\n")

            async with self._rollout_lock:
                try:
                    summary = await run_rollout(self, req, progress)
                except RolloutError as e:
                    summary = {"ok": False, "error": str(e), "steps": []}
                except Exception as e:  # the caller gets a summary, whatever happened
                    log.exception("rollout of %s failed", req.pool)
                    summary = {
                        "ok": False,
                        "error": f"the rollout failed unexpectedly: {type(e).__name__}: {e}",
                        "steps": [],
                    }
            await progress({"event": "summary", **summary})
            await resp.write_eof()
            return resp

        async def convert(request: web.Request) -> web.Response:
            """Move one replica to another pool (dynamic precision); answers when done."""
            from pydantic import ValidationError

            from unbroken.pipeline.convert import ConvertRequest, run_convert

            try:
                req = ConvertRequest.model_validate_json(await request.read())
            except ValidationError as e:
                return web.json_response({"error": {"message": str(e)}}, status=400)
            if self._rollout_lock.locked():
                msg = "a rollout, conversion or reload is already running"
                return web.json_response({"error": {"message": msg}}, status=409)

            async def progress(ev: dict[str, Any]) -> None:
                detail = ev.get("reason") or ev.get("new") or ""
                log.info("convert %s -> %s: %s %s", req.endpoint, req.to_pool, ev["event"], detail)

            async with self._rollout_lock:
                try:
                    summary = await run_convert(self, req, progress)
                except RolloutError as e:
                    return web.json_response({"error": {"message": str(e)}}, status=400)
                except Exception as e:
                    log.exception("conversion of %s failed", req.endpoint)
                    summary = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            return web.json_response(summary)

        async def scale(request: web.Request) -> web.Response:
            """Resize an autoscaled pool (the controller's autoscaler); answers when done."""
            from pydantic import ValidationError

            from unbroken.pipeline.scale import ScaleRequest, run_scale

            try:
                req = ScaleRequest.model_validate_json(await request.read())
            except ValidationError as e:
                return web.json_response({"error": {"message": str(e)}}, status=400)
            if self._rollout_lock.locked():
                msg = "a rollout, conversion, scaling or reload is already running"
                return web.json_response({"error": {"message": msg}}, status=409)

            async def progress(ev: dict[str, Any]) -> None:
                if ev["event"] in ("started", "finished", "rollback", "drain_failed"):
                    log.info("scale %s: %s %s", req.pool, ev["event"], _brief(ev))

            async with self._rollout_lock:
                self.scaling = f"{req.pool} -> {req.replicas}"
                try:
                    summary = await run_scale(self, req, progress)
                except RolloutError as e:
                    return web.json_response({"error": {"message": str(e)}}, status=400)
                except Exception as e:
                    log.exception("scaling of %s failed", req.pool)
                    summary = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                finally:
                    self.scaling = None
                self.save_plane()
            return web.json_response(summary)

        async def pools(request: web.Request) -> web.Response:
            """The pools as the autoscaler needs them, without asking the gateway: cheap
            enough to read every scaling interval."""
            return web.json_response(
                {
                    "busy": self._rollout_lock.locked(),
                    "scaling": self.scaling,
                    "pools": [
                        {
                            "name": p.name,
                            "model": p.model_of(self.spec),
                            "precision": p.precision,
                            "declared": p.replicas,
                            "live": sum(1 for r in self.replicas_of(p.name) if r.serving),
                            "autoscale": p.autoscale.model_dump() if p.autoscale else None,
                            "scaling": p.scaling.model_dump(),
                        }
                        for p in self.spec.pools
                    ],
                }
            )

        async def events(request: web.Request) -> web.Response:
            return web.json_response({"events": self.events})

        async def reload(request: web.Request) -> web.Response:
            try:
                return web.json_response(await self.reload())
            except ReloadError as e:
                return web.json_response({"error": str(e)}, status=e.status)
            except Exception as e:  # the caller gets an answer, whatever happened
                log.exception("reload failed")
                msg = f"the reload failed unexpectedly: {type(e).__name__}: {e}"
                return web.json_response({"error": msg}, status=500)

        app = web.Application()
        app.router.add_get("/status", status)
        app.router.add_get("/events", events)
        app.router.add_post("/rollout", rollout)
        app.router.add_post("/convert", convert)
        app.router.add_post("/scale", scale)
        app.router.add_get("/pools", pools)
        app.router.add_post("/reload", reload)
        self._control = web.AppRunner(app, access_log=None)
        await self._control.setup()
        await web.UnixSite(self._control, str(sock)).start()
        os.chmod(sock, 0o600)

    async def stop(self) -> None:
        """Engines first (they finish what they hold), then the gateway."""
        self._stopping = True
        await self.companions.stop()  # the controller first: it must not react to the stop
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(
            *(self.stop_replica(r, timeout=10) for r in list(self.replicas.values())),
            return_exceptions=True,
        )
        if self.gateway_proc is not None and self.gateway_proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.gateway_proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.gateway_proc.wait(), 10)
            except TimeoutError:
                self.gateway_proc.kill()
                await self.gateway_proc.wait()
        if self._control is not None:
            await self._control.cleanup()
        if self._lock_fd is not None:  # run.json is ours only if the directory was
            for name in ("run.json", PLANE_FILE):
                with contextlib.suppress(FileNotFoundError):
                    (self.state / name).unlink()
        await self.admin.close()
        self.unlock()


def _brief(ev: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in ev.items() if k not in ("event", "t"))


def render_gateway_settings(spec: PipelineSpec) -> GatewaySettings:
    """The settings the gateway of `unbroken up` runs with (STATE/gateway.json), at start and
    at every reload: the spec's gateway section; priorities it does not route prefer the pools
    in spec order (primary first, then fallback), not in the order their engines happened to
    become ready; each pool's upstream key by the name of the variable that carries it."""
    settings = spec.gateway_settings()
    order = [p.name for p in spec.pools]
    for prio in ("critical", "standard", "sheddable"):
        settings.routes.setdefault(prio, list(order))  # type: ignore[call-overload]
    for pool in spec.pools:
        if _pool_key(pool) is not None:  # the key itself travels in the environment
            settings.upstream_key_env[pool.name] = _key_var(pool.name)
    return settings


_MISSING = "(absent)"


def _flatten(d: dict[str, Any], prefix: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "priority_keys":  # its keys are API keys
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def _hidden(v: Any) -> Any:
    if v == _MISSING:
        return v
    return f"{len(v)} key(s), hidden" if isinstance(v, dict) else "(hidden)"


def _change(key: str, old: Any, new: Any) -> dict[str, Any]:
    """One line of a reload's report; never a secret: API keys (`priority_keys`' keys are
    API keys too) and engine environment values are hidden."""
    parts = key.split(".")
    if parts[-1] in ("api_key", "priority_keys", "api_keys") or (
        len(parts) > 1 and parts[-2] == "env"
    ):
        old, new = _hidden(old), _hidden(new)
    return {"key": key, "old": old, "new": new}


def _diff(old: dict[str, Any], new: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        _change(k, old.get(k, _MISSING), new.get(k, _MISSING))
        for k in sorted(old.keys() | new.keys())
        if old.get(k, _MISSING) != new.get(k, _MISSING)
    ]


def _not_applied(running: PipelineSpec, new: PipelineSpec) -> list[dict[str, Any]]:
    """What differs between the running pipeline and the spec read again, outside what a
    reload applies (gateway settings but GATEWAY_RESTART_KEYS, pool caps)."""
    a, b = running.model_dump(mode="json"), new.model_dump(mode="json")
    out = [_change("model", a["model"], b["model"])] if a["model"] != b["model"] else []
    out += _diff(
        {f"gateway.{k}": a["gateway"][k] for k in GATEWAY_RESTART_KEYS},
        {f"gateway.{k}": b["gateway"][k] for k in GATEWAY_RESTART_KEYS},
    )
    pa = {p["name"]: p for p in a["pools"]}
    pb = {p["name"]: p for p in b["pools"]}
    for name in sorted(pa.keys() | pb.keys(), key=lambda n: (n not in pa, n)):
        if name not in pb:
            out.append({"key": f"pools.{name}", "old": "(running)", "new": "(removed)"})
        elif name not in pa:
            out.append({"key": f"pools.{name}", "old": _MISSING, "new": "(new pool)"})
        else:
            pa[name].pop("cap"), pb[name].pop("cap")  # applied
            if pa[name].get("autoscale") and pb[name].get("autoscale"):
                # The autoscaler's count, not the spec's starting one: not a change.
                pa[name].pop("replicas"), pb[name].pop("replicas")
            out += _diff(_flatten(pa[name], f"pools.{name}."), _flatten(pb[name], f"pools.{name}."))
    if list(pa) != list(pb) and pa.keys() == pb.keys():  # the default routes' order
        out.append(_change("pools (order)", list(pa), list(pb)))
    for section in ("controller", "agent"):
        out += _diff(_flatten(a[section], f"{section}."), _flatten(b[section], f"{section}."))
    return out


def _reload_failure(path: Path, offset: int) -> str | None:
    """The gateway's own words when it abandoned a reload (logged after `offset`)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if any(m in line for m in ("reload failed", "reload: cannot read", "already under way")):
            return line.split(": ", 1)[-1]  # the message, without time, level and logger
    return None


def _serial_of(name: str, pool: str) -> int | None:
    head, _, n = name.rpartition("-")
    return int(n) if head == pool and n.isdigit() else None


def _pool_key(pool: PoolSpec) -> str | None:
    """The pool's upstream API key, from the spec or the environment variable it names."""
    if pool.api_key:
        return pool.api_key
    if pool.api_key_env:
        return os.environ.get(pool.api_key_env) or None
    return None


def _key_var(pool: str) -> str:
    return "UNBROKEN_POOL_KEY_" + pool.upper().replace("-", "_")


def _tail(path: Path | None, lines: int = 15) -> str:
    if path is None:
        return ""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
