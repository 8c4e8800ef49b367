"""The gateway of a local pipeline as a process: its settings (STATE/gateway.json, rendered
from the spec by `render_gateway_settings`, at start and at every reload), its command line
and environment (the admin token and pools' upstream keys travel there, never in the file),
its start (until the admin API answers) and its watch: a gateway that dies is restarted on
the same ports with backoff and given every live engine again; one that exits 0 was stopped
on purpose, and the pipeline ends with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from unbroken.clients import AdminError
from unbroken.config.spec import GatewaySettings, PipelineSpec
from unbroken.pipeline.niceness import set_session_nice
from unbroken.pipeline.procs import (
    Adopted,
    Proc,
    StartupError,
    backoff,
    first_line,
    log_size,
    tail,
    terminate,
)
from unbroken.pipeline.replicas import key_var, pool_key
from unbroken.wire.http import READINESS_LEAD_S

if TYPE_CHECKING:
    from unbroken.pipeline.supervisor import Supervisor

__all__ = ["SHUTDOWN_S", "STOP_S", "GatewayProcess", "render_gateway_settings"]

log = logging.getLogger("unbroken.pipeline")

START_TIMEOUT_S = 30.0  # until its admin API answers
# The gateway's drain at a stop (its --shutdown-timeout): open streams finish within it, and
# what is still open then ends with its SSE `shutdown` event (docs/gateway.md).
SHUTDOWN_S = 8.0
# How long a stop waits for the gateway before SIGKILL: the readiness lead before its
# listener closes, the drain, the 5 s its main process then allows its workers to exit
# (_main_gateway.shutdown), and a margin. A SIGKILL before that would cut streams silently.
STOP_S = READINESS_LEAD_S + SHUTDOWN_S + 5.0 + 2.0


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
        if pool_key(pool) is not None:  # the key itself travels in the environment
            settings.upstream_key_env[pool.name] = key_var(pool.name)
    return settings


class GatewayProcess:
    """The gateway's process (`proc`, ours or adopted) and the command line it runs."""

    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup
        self.proc: Proc | None = None
        self.argv: list[str] = []
        self.config = sup.state / "gateway.json"
        self.log = sup.logs / "gateway.log"
        self._since = 0  # the log's size when this start began (`tail` shows only this one's)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def env(self) -> dict[str, str]:
        env = {"UNBROKEN_ADMIN_TOKEN": self.sup.token}
        for pool in self.sup.spec.pools:
            if (key := pool_key(pool)) is not None:
                env[key_var(pool.name)] = key
        return env

    def write_config(self, settings: GatewaySettings) -> Path:
        fd = os.open(self.config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(settings.model_dump_json(indent=1))
        os.chmod(self.config, 0o600)  # a file left by an older run may have been 0644
        return self.config

    def make_argv(self) -> list[str]:
        cfg = self.write_config(render_gateway_settings(self.sup.spec))
        # Workers (at least 2, so that `unbroken reload` can replace them: SIGHUP keeps the
        # main process, and so its pid, which is why a reload never looks like a crash here).
        # The drain fits in the STOP_S that stop() waits before SIGKILL.
        workers = max(2, min(len(os.sched_getaffinity(0)), 8))
        return [
            *[sys.executable, "-m", "unbroken", "gateway", "--config", str(cfg)],
            *["--workers", str(workers), "--shutdown-timeout", f"{SHUTDOWN_S:g}"],
        ]

    def adopt(self, proc: Adopted, argv: list[str]) -> None:
        """A gateway an earlier supervisor started, still serving: ours from now on."""
        self.proc, self.argv = proc, argv

    async def start(self) -> None:
        """Start it and wait until its admin API answers (StartupError otherwise)."""
        self.argv = self.make_argv()
        self._since = log_size(self.sup.logs / "gateway.log")
        self.proc, self.log = await self.sup.spawn("gateway", self.argv, self.env())
        self._prioritise(self.proc.pid)
        self.sup.save_plane()
        await self._wait_admin()

    def _prioritise(self, pid: int) -> None:
        """The gateway's session at `gateway.nice` (before its workers start: they inherit
        it). On a 2-core machine shared with the engines, a surge replica's weight read left
        the gateway's workers runnable but waiting for CPU, and every engine's tokens reached
        the clients in bursts: 1-26 first tokens over 150 ms in each demo rollout's first
        surge at nice 0 (7 runs), none in 7 of 11 at -5 (docs/rollout.md). The engines lose
        little: the gateway's CPU per token is small, and what it does not relay in time, no
        client sees anyway."""
        nice = self.sup.spec.gateway.nice
        if not nice:
            return
        try:
            set_session_nice(pid, nice)
        except OSError as e:
            log.warning(
                "gateway at nice 0, not %d: %s (a negative nice value needs root or "
                "CAP_SYS_NICE; gateway.nice: 0 turns this off)",
                nice,
                e.strerror or e,
            )

    async def _wait_admin(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert self.proc is not None
            if self.proc.returncode is not None:
                raise StartupError(
                    f"the gateway exited with {self.proc.returncode}; "
                    f"log: {self.log}\n" + tail(self.log, since=self._since)
                )
            try:
                await self.sup.admin.status()
                return
            except AdminError:
                if time.monotonic() > deadline:
                    raise StartupError(
                        f"the gateway's admin API did not answer at {self.sup.admin_url}; "
                        f"log: {self.log}"
                    ) from None
                await asyncio.sleep(0.1)

    async def watch(self) -> None:
        """A gateway that dies is restarted on the same ports and given every live engine
        again (its streams are gone with it; new requests are served again in seconds).
        Failed restarts back off; a gateway that exits 0 was stopped on purpose (SIGTERM),
        which ends the pipeline instead."""
        sup = self.sup
        failures = 0
        up_since = time.monotonic()
        while not sup.closing:
            assert self.proc is not None
            code = await self.proc.wait()
            if sup.closing:
                return
            pid = self.proc.pid
            if code == 0 and not isinstance(self.proc, Adopted):
                log.warning("the gateway (pid %s) stopped (exit 0); stopping the pipeline", pid)
                sup.record("gateway_stopped", pid=pid, code=code)
                sup.stopped.set()
                return
            if time.monotonic() - up_since > 60:
                failures = 0  # it ran fine for a while: this is a new incident
            log.warning("the gateway (pid %s) exited unexpectedly with %s", pid, code)
            sup.record("gateway_died", pid=pid, code=code)
            while not sup.closing:
                if failures:
                    delay = backoff(failures)
                    log.info("restarting the gateway in %.0f s", delay)
                    await asyncio.sleep(delay)
                sup.gateway_restarts += 1
                try:
                    await self.start()
                    for r in list(sup.replicas.values()):
                        if r.alive and not r.stopping:
                            await sup.register(r)
                    sup.record("gateway_restarted", pid=self.proc.pid)
                    up_since = time.monotonic()
                    failures += 1
                    break
                except (StartupError, AdminError) as e:
                    failures += 1
                    why = first_line(e)
                    log.error("could not restart the gateway: %s", why)
                    sup.record("gateway_restart_failed", error=why, attempt=failures)
                    if self.proc is not None and self.proc.returncode is None:
                        with contextlib.suppress(ProcessLookupError):
                            self.proc.kill()
                        await self.proc.wait()

    async def stop(self, timeout: float = STOP_S) -> None:
        """SIGTERM: it stops taking requests, lets its streams finish for SHUTDOWN_S and
        ends the rest with its `shutdown` event; SIGKILL only after `timeout`."""
        if self.proc is not None and self.proc.returncode is None:
            await terminate(self.proc, timeout, "the gateway")
