"""The main process's gateway (`--workers N`, N > 1): what the workers serve from, and the
changes to it (`_main.py` describes the process model).

`MainGateway` owns the endpoints' columns of the shared admission table, sends the workers
the state (`_messages.state_message`) whenever it changes and every STATE_S, answers the
admin API once every worker has applied a change, runs reloads (SIGHUP: a new generation of
workers, then the old ones drain or hand their streams over) and the shutdown. The worker
processes themselves (start, control messages, deaths, metrics) are the layer below,
`_main_workers.WorkerProcesses`; the process's life (listening socket, signals) is `_main`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unbroken.config.spec import GatewaySettings
from unbroken.gateway._admin import admin_app
from unbroken.gateway._main_workers import Worker, WorkerGauge, WorkerProcesses
from unbroken.gateway._messages import (
    DrainMsg,
    ForceMsg,
    RebalanceMsg,
    StateMsg,
    encode,
    state_message,
)
from unbroken.gateway._pool import Endpoint, State
from unbroken.gateway._prefix_table import PrefixTable
from unbroken.gateway._process import READINESS_LEAD_S
from unbroken.gateway._server import StaticEndpoint, _bound_port
from unbroken.gateway._shared import MAX_ENDPOINTS, MAX_WORKERS, SharedCounters, SharedSlot
from unbroken.gateway._tenant_table import MAX_TENANTS, TenantTable
from unbroken.wire.heap import freeze_startup_heap
from unbroken.wire.http import ServerLimits, start_site

if TYPE_CHECKING:
    from unbroken.gateway._discovery import K8sSettings

__all__ = ["MainGateway"]

log = logging.getLogger("unbroken.gateway.main")

STATE_S = 0.25  # scraped engine load reaches the workers at least this often
SYNC_S = 2.0  # an admin change waits at most this long for the workers to apply it
TAKEOVER_HOLD_S = 20.0  # orphaned workers serve at most this long while endpoints get ready


class MainGateway(WorkerProcesses):
    def __init__(
        self,
        cfg: GatewaySettings,
        token: str,
        shared: SharedCounters,
        listen: socket.socket,
        tmp: Path,
        n_workers: int,
        prefix_table: PrefixTable | None = None,
        tenant_table: TenantTable | None = None,
    ) -> None:
        # Tenants' slots in the shared tenant table, by name, kept across reloads (a tenant
        # keeps its counts; a new one gets a cleared slot).
        self.tenant_slots: dict[str, int] = {}
        if tenant_table is not None:
            self._assign_tenant_slots(cfg, tenant_table)
        super().__init__(cfg, token, shared, prefix_table, tenant_table, self.tenant_slots)
        self.shared = shared
        self.prefix_table = prefix_table  # the workers' prefix index; its columns are ours
        self.listen = listen
        self.tmp = tmp
        self.n_workers = n_workers
        self.shutdown_timeout = 30.0  # what a worker allows its streams if this process dies
        self.workers: list[Worker] = []
        self.generation = 0
        self.replaced = 0
        self._quick_deaths = 0
        self.reloads = 0
        self.reload_error: str | None = None
        self.stopping = False
        self._free_cols = list(range(MAX_ENDPOINTS - 1, -1, -1))
        self._retired: list[int] = []  # columns of removed endpoints, until their count is 0
        self._free_rows = list(range(MAX_WORKERS - 1, -1, -1))
        self._ids = itertools.count()
        self._asked: dict[int, tuple[asyncio.Future[str], int]] = {}
        self._retired_metrics = ""  # counters of workers that have exited (reloads, deaths)
        self._broadcast_soon = False
        self._seq = 0
        self._reloading: asyncio.Task[None] | None = None
        self.took_over = False  # the listener came from orphaned workers of a dead main
        self.metrics.registry.register(WorkerGauge(self))

    def _assign_tenant_slots(self, cfg: GatewaySettings, table: TenantTable) -> None:
        taken = set(self.tenant_slots.values())
        free = (i for i in range(MAX_TENANTS) if i not in taken)
        for t in cfg.tenants or ():
            if t.name not in self.tenant_slots:
                slot = next(free, None)
                if slot is None:
                    raise RuntimeError(f"more than {MAX_TENANTS} tenants")
                table.clear_slot(slot)
                self.tenant_slots[t.name] = slot

    # -- endpoints: columns of the shared table -------------------------------------------------
    def _attach(self, ep: Endpoint) -> None:
        if not self._free_cols:
            self._reclaim()
        if not self._free_cols:
            raise RuntimeError(f"more than {MAX_ENDPOINTS} endpoints")
        col = self._free_cols.pop()
        self.shared.clear_col(col)
        if self.prefix_table is not None:
            # A reused column must not credit the new endpoint with the old one's prefixes.
            self.prefix_table.clear(col)
        ep.slot = SharedSlot(self.shared, col)

    def _on_restart(self, ep: Endpoint) -> None:
        super()._on_restart(ep)
        if self.prefix_table is not None:
            # The workers' index is this shared table (a worker's own `forget` leaves it).
            self.prefix_table.clear(ep.slot.col)  # type: ignore[attr-defined]

    def _reclaim(self) -> None:
        still = []
        for col in self._retired:
            (self._free_cols if self.shared.total(col) == 0 else still).append(col)
        self._retired = still

    def remove_endpoint(self, ep: Endpoint) -> None:
        was = self.pool.get(ep.name) is ep
        super().remove_endpoint(ep)
        if was:
            self._retired.append(ep.slot.col)  # type: ignore[attr-defined]
        self._changed()

    def drain_endpoint(self, ep: Endpoint, deadline_s: float | None) -> None:
        super().drain_endpoint(ep, deadline_s)
        self._changed()

    def rebalance(
        self,
        ep: Endpoint,
        priorities: Iterable[str],
        batch: int | None = None,
        every_s: float = 0.1,
    ) -> int:
        """The streams live in the workers: each one moves its own (its share of `batch`)."""
        serving = [w for w in self.workers if not w.draining]
        share = None if batch is None else max(1, -(-batch // max(1, len(serving))))
        for w in serving:
            w.send(
                RebalanceMsg(
                    t="rebalance",
                    endpoint=ep.name,
                    priorities=list(priorities),
                    batch=share,
                    every_s=every_s,
                )
            )
        return -1  # unknown here: the workers count them in their migration metrics

    def _changed(self) -> None:
        super()._changed()
        if not self._broadcast_soon:
            self._broadcast_soon = True
            asyncio.get_running_loop().call_soon(self.broadcast)

    def snapshot(self) -> StateMsg:
        """The state the workers serve from (`_messages.state_message`)."""
        d = self.discovery
        # How many gateway replicas share the tenants' limits, and this one's rank.
        replicas = [d.replicas, d.rank] if d is not None else [1, 0]
        return state_message(self.pool, self._seq, self.closing, replicas, time.monotonic())

    def broadcast(self) -> None:
        self._broadcast_soon = False
        self._seq += 1
        msg = encode(self.snapshot())
        for w in self.workers:
            if not w.writer.is_closing():
                w.writer.write(msg)

    async def sync(self) -> None:
        """Send the state now and wait until every serving worker has applied it, so that
        an admin call's answer means the change is live (bounded: a stuck worker is not
        waited for past SYNC_S)."""
        self.broadcast()
        seq = self._seq
        deadline = time.monotonic() + SYNC_S
        while time.monotonic() < deadline and any(
            w.acked < seq for w in self.workers if not w.draining and w.up.is_set()
        ):
            await asyncio.sleep(0.002)

    async def _tick(self) -> None:
        """Remove drained endpoints once no worker holds a slot on them; refresh the
        workers' view of engine load."""
        while True:
            await asyncio.sleep(STATE_S)
            for ep in list(self.pool.endpoints.values()):
                if ep.state == State.DRAINING and ep.inflight == 0:
                    self.remove_endpoint(ep)
            self._reclaim()
            self.broadcast()

    def process_status(self) -> dict[str, Any]:
        return {
            "workers": {
                # Serving: said it serves, and not draining; starting: not yet (at start, a
                # reload's new workers, a replacement). `pids`: both.
                "serving": sum(w.serving for w in self.workers),
                "starting": sum(w.starting for w in self.workers),
                "draining": sum(w.draining for w in self.workers),
                "pids": [w.proc.pid for w in self.workers if not w.draining],
                "starting_pids": [w.proc.pid for w in self.workers if w.starting],
                "draining_pids": [w.proc.pid for w in self.workers if w.draining],
                "main_pid": os.getpid(),
                "generation": self.generation,
                # The last reload that changed nothing because it failed, and why (None
                # once a later one succeeds).
                "last_reload_error": self.reload_error,
            }
        }

    def reload(self, reload_cfg: Callable[[], GatewaySettings] | None) -> None:
        if self.stopping:
            return
        if self._reloading is not None and not self._reloading.done():
            log.warning("SIGHUP: a reload is already under way; ignored")
            self.reload_error = "a reload was already under way; this one was ignored"
            return
        self._reloading = asyncio.create_task(self._reload(reload_cfg))

    async def _reload(self, reload_cfg: Callable[[], GatewaySettings] | None) -> None:
        """A new generation of workers on the settings read now; the old ones drain once
        all of them serve. Nothing of the new settings is applied before that (but the new
        tenants' slots, which the new workers need): a reload that fails leaves the gateway
        exactly as it was, and the next one starts afresh."""
        gen = self.generation + 1
        prev = self.cfg
        cfg = prev
        slots = dict(self.tenant_slots)
        if reload_cfg is not None:
            try:
                new = reload_cfg()
            except Exception as e:  # the settings on disk are broken: keep serving
                log.error("reload: cannot read the settings (%s); nothing changed", e)
                self.reload_error = f"cannot read the settings: {e}"
                return
            fixed = ("host", "port", "admin_host", "admin_port")
            if any(getattr(new, k) != getattr(prev, k) for k in fixed):
                log.warning("reload: listen addresses cannot change without a restart; kept")
            cfg = new.model_copy(update={k: getattr(prev, k) for k in fixed})
        settings = self.tmp / f"settings-{gen}.json"
        new_ws: list[Worker] = []

        def undo() -> None:
            for w in new_ws:
                w.draining = True  # not replaced when it exits
                with contextlib.suppress(ProcessLookupError):
                    w.proc.kill()
            self.tenant_slots.clear()
            self.tenant_slots.update(slots)
            with contextlib.suppress(OSError):
                settings.unlink()

        if self.tenant_table is not None:
            try:
                self._assign_tenant_slots(cfg, self.tenant_table)
            except RuntimeError as e:
                log.error("reload failed (%s); nothing changed", e)
                self.reload_error = str(e)
                undo()
                return
        try:
            # Written afresh: a failed reload's file (same generation) must not stand.
            settings.write_text(cfg.model_dump_json())
            log.info("reload: starting %d new worker(s), generation %d", self.n_workers, gen)
            for _ in range(self.n_workers):
                new_ws.append(await self.spawn(gen))
            await self._wait_up(new_ws)
            for w in new_ws:
                if w.proc.returncode is not None:
                    raise RuntimeError(f"worker pid {w.proc.pid} exited ({w.proc.returncode})")
        except Exception as e:
            log.error("reload failed (%s): the old workers keep serving", e)
            self.reload_error = f"new workers did not start: {e}"
            undo()
            return
        # The new generation serves: its settings are the gateway's from now on.
        self.cfg = cfg
        self.pool.default_cap = cfg.default_cap
        if cfg.routes != prev.routes:
            # Only when the file's routes changed: an unrelated reload keeps what an
            # operator set through the admin API since.
            self.set_routes({k: list(v) for k, v in cfg.routes.items()})
        self.generation = gen
        self.reloads += 1
        self.reload_error = None
        self._changed()
        # Every older worker, including one that replaced a dead one during the reload.
        old = [w for w in self.workers if not w.draining and w.generation < gen]
        targets = [w.handover for w in new_ws] if cfg.handover_on_reload else []
        for i, w in enumerate(old):
            w.draining = True
            msg = DrainMsg(t="drain", timeout=cfg.request_timeout_s, why="reload")
            if targets:  # each old worker starts on another new one
                k = i % len(targets)
                msg["handover"] = targets[k:] + targets[:k]
            w.send(msg)
        log.info(
            "reload: generation %d serving; %d old worker(s) %s",
            gen,
            len(old),
            "hand their streams over" if targets else "finish their streams",
        )

    async def shutdown(self, timeout: float, force: asyncio.Event) -> None:
        self.stopping = True
        if self._reloading is not None:
            self._reloading.cancel()
        for w in self.workers:
            w.draining = True
            w.send(DrainMsg(t="drain", timeout=timeout, why="shutting down"))
        with contextlib.suppress(OSError):
            self.listen.close()  # with every worker's copy closed, the port is free

        async def forward_force() -> None:
            await force.wait()
            for w in list(self.workers):
                w.send(ForceMsg(t="force"))

        fwd = asyncio.create_task(forward_force())
        procs = [w.proc for w in list(self.workers)]
        try:
            await asyncio.wait_for(
                asyncio.gather(*(p.wait() for p in procs)), timeout + READINESS_LEAD_S + 5
            )
        except TimeoutError:
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
        fwd.cancel()

    async def _wait_ready_endpoint(self) -> None:
        """After taking the listener from orphaned workers: they serve on while this process
        learns its endpoints (the supervisor registers them through the admin API, which
        answers now) and warms them; its own workers start once one is ready, at most
        TAKEOVER_HOLD_S later, so that a request never lands on a worker with none."""
        deadline = time.monotonic() + TAKEOVER_HOLD_S
        while time.monotonic() < deadline:
            if any(e.state == State.READY for e in self.pool.endpoints.values()):
                return
            await asyncio.sleep(0.05)
        log.warning(
            "no endpoint ready within %.0f s of the takeover: serving anyway", TAKEOVER_HOLD_S
        )

    async def start_main(
        self, static: list[StaticEndpoint], *, warmup: bool, k8s: K8sSettings | None
    ) -> None:
        cfg = self.cfg
        self.start_control_plane(static, warmup=warmup, k8s=k8s)
        admin = admin_app(self, self.admin_token)
        admin.router.add_get("/metrics", self.metrics_handler)
        freeze_startup_heap()
        runner = await start_site(
            admin, cfg.admin_host, cfg.admin_port, limits=ServerLimits(cfg.header_timeout_s)
        )
        self._runners = [runner]
        self.admin_port = _bound_port(runner) or cfg.admin_port
        self.port = int(self.listen.getsockname()[1])
        if self.took_over:
            await self._wait_ready_endpoint()
        await self.start_share(publish=False, subscribe=True, owner_pid=os.getpid())
        await self.start_workers()  # after the admin API: once /health answers, so does it
        log.info(
            "gateway on http://%s:%d (%d workers), admin on http://%s:%d",
            cfg.host,
            self.port,
            self.n_workers,
            cfg.admin_host,
            self.admin_port,
        )
