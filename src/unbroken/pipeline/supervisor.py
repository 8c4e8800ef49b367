"""The local supervisor behind `unbroken up`.

It runs the gateway and every engine replica as child processes (own session, killed with
the supervisor through PR_SET_PDEATHSIG, so nothing is orphaned), registers each engine with
the gateway's admin API once `/health` answers (the gateway then warms it up: stage 2), and
replaces a replica that dies. A small control API on a Unix socket serves `unbroken status`.
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
from unbroken.config.paths import RunInfo, cache_dir
from unbroken.config.spec import PipelineSpec, PoolSpec
from unbroken.wire.http import free_port, wait_ok

__all__ = ["Replica", "StartupError", "Supervisor"]

log = logging.getLogger("unbroken.pipeline")


class StartupError(RuntimeError):
    pass


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
    proc: asyncio.subprocess.Process | None = None
    log_path: Path | None = None
    started_at: float = field(default_factory=time.time)
    healthy_at: float | None = None
    stopping: bool = False

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

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
            "alive": self.proc is not None and self.proc.returncode is None,
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
    ) -> None:
        self.spec = spec
        self.state = state
        self.token = token
        self.token_file = token_file
        self.health_timeout = health_timeout
        self.restart = restart
        self.logs = state / "logs"
        self.replicas: dict[str, Replica] = {}
        self.gateway_proc: asyncio.subprocess.Process | None = None
        g = spec.gateway
        self.gateway_url = f"http://{g.host}:{g.port}"
        self.admin_url = f"http://{g.admin_host}:{g.admin_port}"
        self.admin = GatewayAdmin(self.admin_url, token)
        self.restarts = 0
        self._serial = {p.name: itertools.count(1) for p in spec.pools}
        self._weights: dict[str, Path] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stopping = False
        self._control: web.AppRunner | None = None
        self.events: list[dict[str, Any]] = []
        self._rollout_lock = asyncio.Lock()

    # -- processes ----------------------------------------------------------------------------
    async def _spawn(
        self, name: str, argv: list[str], env: dict[str, str] | None = None
    ) -> tuple[asyncio.subprocess.Process, Path]:
        self.logs.mkdir(parents=True, exist_ok=True)
        path = self.logs / f"{name}.log"
        out = open(path, "ab")
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                stdin=asyncio.subprocess.DEVNULL,
                env={**os.environ, **(env or {})},
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        finally:
            out.close()
        return proc, path

    def _gateway_argv(self) -> list[str]:
        cfg = self.state / "gateway.json"
        settings = self.spec.gateway.model_copy(deep=True)
        order = [p.name for p in self.spec.pools]
        for prio in ("critical", "standard", "sheddable"):
            # Unrouted priorities prefer pools in spec order (primary first, then fallback),
            # not in the order their engines happened to become ready.
            settings.routes.setdefault(prio, order)  # type: ignore[call-overload]
        cfg.write_text(settings.model_dump_json(indent=1))
        return [sys.executable, "-m", "unbroken", "gateway", "--config", str(cfg)]

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
        engine then loads from memory, not from disk). None when there is nothing to read."""
        from unbroken.prewarm import PrewarmError, find_weight_files, warm_files

        weights = self.weights_for(pool)
        if weights is None:
            return None
        try:
            files = find_weight_files([str(weights)])
        except PrewarmError as e:
            log.warning("no pre-warm for %s: %s", pool.name, e)
            return None
        stats = await asyncio.get_running_loop().run_in_executor(None, warm_files, files)
        return {
            "files": stats.files,
            "bytes": stats.bytes,
            "seconds": round(stats.seconds, 3),
            "gbps": round(stats.gbps, 2),
        }

    def engine_argv(self, pool: PoolSpec, host: str, port: int) -> list[str]:
        e = pool.engine
        if e.kind == "command":
            assert e.command is not None
            subst = {"port": str(port), "host": host, "model": self.spec.model}
            return [part.format(**subst) for part in e.command]
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
            self.spec.model,
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
        weights = self.weights_for(pool)
        if weights is not None:
            argv += ["--weights", str(weights)]
        return argv

    async def start_replica(self, pool: PoolSpec) -> Replica:
        name = f"{pool.name}-{next(self._serial[pool.name])}"
        port = free_port()
        r = Replica(name=name, pool=pool, port=port)
        env = {"UNBROKEN_ADMIN_TOKEN": self.token, **pool.engine.env}
        r.proc, r.log_path = await self._spawn(name, self.engine_argv(pool, r.host, port), env)
        r.started_at = time.time()
        self.replicas[name] = r
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

    async def register(self, r: Replica) -> None:
        await self.admin.add(url=r.url, name=r.name, pool=r.pool.name, cap=r.pool.cap)

    async def bring_up(self, pool: PoolSpec) -> Replica:
        r = await self.start_replica(pool)
        await self.wait_health(r)
        await self.register(r)
        self.watch(r)
        return r

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
        with contextlib.suppress(AdminError):
            await self.admin.remove(name=r.name)
        if not self.restart:
            return
        self.restarts += 1
        try:
            new = await self.bring_up(r.pool)
            self.record("replica_replaced", replica=r.name, by=new.name, pid=new.pid)
            log.info("%s replaced by %s", r.name, new.name)
        except (StartupError, AdminError) as e:
            log.error("could not replace %s: %s", r.name, e)

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
            self.replicas.pop(r.name, None)

    def record(self, kind: str, **data: Any) -> None:
        self.events.append({"t": time.time(), "event": kind, **data})

    # -- whole pipeline ------------------------------------------------------------------------
    async def start(self, progress: Callable[[str], None] | None = None) -> None:
        say = progress or (lambda _m: None)
        self.state.mkdir(parents=True, exist_ok=True)
        await asyncio.get_running_loop().run_in_executor(None, self.prepare_weights, say)
        say("starting the gateway")
        self.gateway_proc, gw_log = await self._spawn(
            "gateway", self._gateway_argv(), {"UNBROKEN_ADMIN_TOKEN": self.token}
        )
        await self._wait_gateway(gw_log)
        say(f"starting {sum(p.replicas for p in self.spec.pools)} engine replica(s)")
        await asyncio.gather(
            *(self.bring_up(p) for p in self.spec.pools for _ in range(p.replicas))
        )
        say("waiting for every endpoint to pass its warm-up")
        await self.wait_ready()
        self._track(asyncio.create_task(self._watch_gateway(), name="watch-gateway"))
        await self._start_control()
        RunInfo(
            pid=os.getpid(),
            gateway_url=self.gateway_url,
            admin_url=self.admin_url,
            control_socket=str(self.state / "supervisor.sock"),
            token_file=str(self.token_file),
            started=time.time(),
        ).write(self.state)

    def _track(self, t: asyncio.Task[Any]) -> None:
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _watch_gateway(self) -> None:
        """A gateway that dies is restarted on the same ports and given every live engine
        again (its streams are gone with it; new requests are served again in seconds)."""
        while not self._stopping:
            assert self.gateway_proc is not None
            code = await self.gateway_proc.wait()
            if self._stopping:
                return
            log.warning(
                "the gateway (pid %s) exited unexpectedly with %s; restarting it",
                self.gateway_proc.pid,
                code,
            )
            self.record("gateway_died", pid=self.gateway_proc.pid, code=code)
            self.restarts += 1
            try:
                self.gateway_proc, gw_log = await self._spawn(
                    "gateway", self._gateway_argv(), {"UNBROKEN_ADMIN_TOKEN": self.token}
                )
                await self._wait_gateway(gw_log)
                for r in list(self.replicas.values()):
                    if r.proc is not None and r.proc.returncode is None and not r.stopping:
                        await self.register(r)
                self.record("gateway_restarted", pid=self.gateway_proc.pid)
            except (StartupError, AdminError) as e:
                log.error("could not restart the gateway: %s", e)
                await asyncio.sleep(1.0)

    async def _wait_gateway(self, gw_log: Path) -> None:
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
            "replicas": [r.as_dict() for r in self.replicas.values()],
            "restarts": self.restarts,
            "gateway": gw,
            "events": self.events[-50:],
        }

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

            from unbroken.pipeline.rollout import RolloutError, RolloutRequest, run_rollout

            try:
                req = RolloutRequest.model_validate_json(await request.read())
            except ValidationError as e:
                return web.json_response({"error": str(e)}, status=400)
            if self._rollout_lock.locked():
                return web.json_response({"error": "a rollout is already running"}, status=409)
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
            await progress({"event": "summary", **summary})
            await resp.write_eof()
            return resp

        async def events(request: web.Request) -> web.Response:
            return web.json_response({"events": self.events})

        app = web.Application()
        app.router.add_get("/status", status)
        app.router.add_get("/events", events)
        app.router.add_post("/rollout", rollout)
        self._control = web.AppRunner(app, access_log=None)
        await self._control.setup()
        await web.UnixSite(self._control, str(sock)).start()
        os.chmod(sock, 0o600)

    async def stop(self) -> None:
        """Engines first (they finish what they hold), then the gateway."""
        self._stopping = True
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
        with contextlib.suppress(FileNotFoundError):
            (self.state / "run.json").unlink()
        await self.admin.close()


def _tail(path: Path | None, lines: int = 15) -> str:
    if path is None:
        return ""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
