"""The gateway's main process when it runs worker processes (`--workers N`, N > 1).

It owns the listening socket (one socket, inherited by every worker: the kernel's one accept
queue is shared, so a worker that stops accepting leaves what is queued to the others and no
connection is refused), the admin API, the prober and discovery, and the shared admission
table. It sends workers the endpoint state whenever it changes and every STATE_S, merges
their metrics into one /metrics, and:

- SIGHUP (reload): starts N new workers (the code and settings on disk now) on the same
  socket, waits until they serve, then tells the old ones to drain: they stop accepting and
  hand their open streams, with the client connections, to the new workers' handover
  sockets (round-robin; `_handover`, `handover_on_reload`), which continue them by
  continuation. A stream that cannot be handed over finishes where it is: an old worker lives
  until its last such stream ends, at most `request_timeout_s` (no stream outlives that
  anyway); how many are still draining is `unbroken_gateway_workers{state="draining"}`. If a
  new worker fails to start, the old ones keep serving and the log says why.
- SIGTERM: /health answers 503 first, the workers close their listeners READINESS_LEAD_S
  later and finish their streams up to `--shutdown-timeout`; what is left then (or at a
  second SIGTERM) ends with an SSE error event; exit 0.
- A worker that dies is replaced at once; its shared row is zeroed, so the slots its streams
  held come back, and only its own streams are lost.
- This process dying (kill -9): its workers serve on and offer the listening socket at a
  known path (`_handover.takeover_dir`); the next main process on that port (the supervisor's
  restart) takes it there instead of binding, so no connection is refused, and the orphans
  then finish their streams and exit (`_worker.WorkerGateway.lost_main`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from unbroken.config.spec import GatewaySettings
from unbroken.gateway._admin import admin_app
from unbroken.gateway._handover import take_listener
from unbroken.gateway._messages import (
    AggrMsg,
    DrainMsg,
    ForceMsg,
    MetricsAsk,
    RebalanceMsg,
    StateMsg,
    ToMain,
    ToWorker,
    WorkerSpec,
    decode,
    encode,
    state_message,
)
from unbroken.gateway._metrics import merge_expositions, retire
from unbroken.gateway._pool import Endpoint, State
from unbroken.gateway._prefix_table import PrefixTable, table_entries
from unbroken.gateway._process import (
    READINESS_LEAD_S,
    UNREADY_WARNING_S,
    resolve_token,
    second_forces,
    warn_unready,
)
from unbroken.gateway._ratelimit import MAX_TENANTS, TenantTable
from unbroken.gateway._server import Gateway, StaticEndpoint, _bound_port
from unbroken.gateway._shared import MAX_ENDPOINTS, MAX_WORKERS, SharedCounters, SharedSlot
from unbroken.wire.heap import freeze_startup_heap
from unbroken.wire.http import ServerLimits, start_site

if TYPE_CHECKING:
    from unbroken.gateway._discovery import K8sSettings

__all__ = ["MainGateway", "serve_main"]

log = logging.getLogger("unbroken.gateway.main")

STATE_S = 0.25  # scraped engine load reaches the workers at least this often
START_TIMEOUT_S = 30.0  # a new worker must serve within this, or the reload is abandoned
SYNC_S = 2.0  # an admin change waits at most this long for the workers to apply it
METRICS_WAIT_S = 2.0  # a /metrics scrape waits this long for the workers' expositions
TAKEOVER_HOLD_S = 20.0  # orphaned workers serve at most this long while endpoints get ready


@dataclass(eq=False)
class Worker:
    proc: asyncio.subprocess.Process
    row: int
    generation: int
    writer: asyncio.StreamWriter
    handover: str = ""  # its handover socket (streams of old workers come in there)
    up: asyncio.Event = field(default_factory=asyncio.Event)
    draining: bool = False
    acked: int = -1  # the last state message it applied
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    # Its latest /metrics exposition: stands in for it while it is late to answer, and is
    # what of its counters outlives it.
    last_metrics: str = ""
    late: bool = False
    reading: asyncio.Task[None] | None = None  # its control socket's reader

    def send(self, msg: ToWorker) -> None:
        if not self.writer.is_closing():
            self.writer.write(encode(msg))


class _WorkerGauge(Collector):
    def __init__(self, main: MainGateway) -> None:
        self.main = main

    def collect(self) -> Iterator[GaugeMetricFamily]:
        g = GaugeMetricFamily(
            "unbroken_gateway_workers",
            "Worker processes: serving, and old ones still finishing their streams after a "
            "reload or during shutdown.",
            labels=["state"],
        )
        ws = self.main.workers
        g.add_metric(["serving"], sum(not w.draining for w in ws))
        g.add_metric(["draining"], sum(w.draining for w in ws))
        r = GaugeMetricFamily(
            "unbroken_gateway_worker_restarts",
            "Workers that died and were replaced, and reloads done, since start.",
            labels=["kind"],
        )
        r.add_metric(["replaced"], self.main.replaced)
        r.add_metric(["reload"], self.main.reloads)
        yield from (g, r)


class MainGateway(Gateway):
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
        self.metrics.registry.register(_WorkerGauge(self))

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
        if self.prefix_table is not None:
            # A reused column must not credit the new endpoint with the old one's prefixes.
            self.prefix_table.clear(col)
        ep.slot = SharedSlot(self.shared, col)

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
                "serving": sum(not w.draining for w in self.workers),
                "draining": sum(w.draining for w in self.workers),
                "pids": [w.proc.pid for w in self.workers if not w.draining],
                "draining_pids": [w.proc.pid for w in self.workers if w.draining],
                "main_pid": os.getpid(),
                "generation": self.generation,
                # The last reload that changed nothing because it failed, and why (None
                # once a later one succeeds).
                "last_reload_error": self.reload_error,
            }
        }

    # -- workers ------------------------------------------------------------------------------
    async def spawn(self, generation: int) -> Worker:
        if not self._free_rows:
            raise RuntimeError(f"{MAX_WORKERS} workers are running or still draining")
        row = self._free_rows.pop()
        self.shared.clear_row(row)
        if self.tenant_table is not None:
            self.tenant_table.clear_row(row)
        cfg_path = self.tmp / f"settings-{generation}.json"
        if not cfg_path.exists():
            cfg_path.write_text(self.cfg.model_dump_json())
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        handover = str(self.tmp / f"handover-{next(self._ids)}.sock")
        spec = WorkerSpec(
            cfg=str(cfg_path),
            shm=str(self.shared.path),
            prefix=None if self.prefix_table is None else str(self.prefix_table.path),
            tenants=None
            if self.tenant_table is None
            else {"path": str(self.tenant_table.path), "slots": self.tenant_slots},
            row=row,
            ctl_fd=child.fileno(),
            listen_fd=self.listen.fileno(),
            log_level=logging.getLogger().getEffectiveLevel(),
            main_pid=os.getpid(),
            shutdown_timeout=self.shutdown_timeout,
            handover=handover,
        )
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "unbroken.gateway._worker",
                pass_fds=(child.fileno(), self.listen.fileno()),
                env={**os.environ, "UNBROKEN_GW_WORKER": orjson.dumps(spec).decode()},
            )
        except OSError:
            self._free_rows.append(row)
            raise
        finally:
            child.close()
        reader, writer = await asyncio.open_unix_connection(sock=parent, limit=64 * 2**20)
        w = Worker(proc, row, generation, writer, handover)
        w.send(self.snapshot())
        self.workers.append(w)
        w.reading = asyncio.create_task(self._read(w, reader))
        w.tasks = [w.reading, asyncio.create_task(self._watch(w))]
        log.info("worker pid %d started (row %d, generation %d)", proc.pid, row, generation)
        return w

    async def _read(self, w: Worker, reader: asyncio.StreamReader) -> None:
        with contextlib.suppress(ConnectionError):
            while line := await reader.readline():
                msg: ToMain = decode(line)
                t = msg["t"]
                if t == "ack":
                    w.acked = msg["seq"]
                elif t == "up":
                    w.up.set()
                elif t == "suspect":
                    ep = self.pool.get(msg["name"])
                    if ep is not None and self.prober is not None:
                        self.prober.suspect(ep)
                elif t == "metrics":
                    w.last_metrics = msg["text"]  # a late answer still updates the stand-in
                    got = self._asked.get(msg["id"])
                    if got is not None and not got[0].done():
                        got[0].set_result(msg["text"])
                elif t == "handed":
                    self.metrics.handed_over.labels(msg["dir"]).inc()
                elif t == "aggr?":
                    task = asyncio.create_task(self._answer_metrics(w, msg["id"]))
                    w.tasks.append(task)
                    task.add_done_callback(w.tasks.remove)

    async def _watch(self, w: Worker) -> None:
        code = await w.proc.wait()
        self.workers.remove(w)
        self.shared.clear_row(w.row)  # what its streams held is free again
        if self.tenant_table is not None:
            self.tenant_table.clear_row(w.row)  # and the tenants' streams it had open
        self._free_rows.append(w.row)
        w.writer.close()
        # Its last word may still be unread in the control socket: read to the end first
        # (the exit closed the worker's end, so this is quick).
        if w.reading is not None:
            await asyncio.wait([w.reading], timeout=1.0)
        if w.last_metrics:  # what it counted stays counted
            self._retired_metrics = retire(self._retired_metrics, w.last_metrics)
            w.last_metrics = ""
        for fut, row in self._asked.values():
            if row == w.row and not fut.done():
                fut.set_result("")
        self._changed()  # waiters may fit in the freed slots
        if w.draining or self.stopping:
            log.info("worker pid %d exited (%s) after draining", w.proc.pid, code)
            return
        log.error("worker pid %d died (exit %s): replacing it", w.proc.pid, code)
        self.replaced += 1
        while not self.stopping:
            try:
                await self.spawn(w.generation)
                return
            except (OSError, RuntimeError) as e:
                log.error("cannot start a worker: %s; retrying", e)
                await asyncio.sleep(1.0)

    async def start_workers(self) -> None:
        ws = [await self.spawn(self.generation) for _ in range(self.n_workers)]
        await self._wait_up(ws)

    async def _wait_up(self, ws: list[Worker]) -> None:
        async def one(w: Worker) -> None:
            up = asyncio.create_task(w.up.wait())
            done, _ = await asyncio.wait(
                [up, asyncio.create_task(w.proc.wait())],
                timeout=START_TIMEOUT_S,
                return_when=asyncio.FIRST_COMPLETED,
            )
            if up not in done:
                up.cancel()
                raise RuntimeError(f"worker pid {w.proc.pid} did not start serving")

        await asyncio.gather(*(one(w) for w in ws))

    def reload(self, reload_cfg: Callable[[], GatewaySettings] | None) -> None:
        if self.stopping:
            return
        if self._reloading is not None and not self._reloading.done():
            log.warning("SIGHUP: a reload is already under way; ignored")
            self.reload_error = "a reload was already under way; this one was ignored"
            return
        self._reloading = asyncio.create_task(self._reload(reload_cfg))

    async def _reload(self, reload_cfg: Callable[[], GatewaySettings] | None) -> None:
        old = [w for w in self.workers if not w.draining]
        gen = self.generation + 1
        if reload_cfg is not None:
            try:
                new = reload_cfg()
            except Exception as e:  # the settings on disk are broken: keep serving
                log.error("reload: cannot read the settings (%s); nothing changed", e)
                self.reload_error = f"cannot read the settings: {e}"
                return
            fixed = ("host", "port", "admin_host", "admin_port")
            if any(getattr(new, k) != getattr(self.cfg, k) for k in fixed):
                log.warning("reload: listen addresses cannot change without a restart; kept")
            prev = self.cfg
            self.cfg = new.model_copy(update={k: getattr(self.cfg, k) for k in fixed})
            if self.tenant_table is not None:
                try:
                    self._assign_tenant_slots(self.cfg, self.tenant_table)
                except RuntimeError as e:
                    log.error("reload: %s; nothing changed", e)
                    self.reload_error = str(e)
                    self.cfg = prev
                    return
            self.pool.default_cap = self.cfg.default_cap
            if self.cfg.routes != prev.routes:
                # Only when the file's routes changed: an unrelated reload keeps what an
                # operator set through the admin API since.
                self.set_routes({k: list(v) for k, v in self.cfg.routes.items()})
        log.info("reload: starting %d new worker(s), generation %d", self.n_workers, gen)
        new_ws: list[Worker] = []
        try:
            for _ in range(self.n_workers):
                new_ws.append(await self.spawn(gen))
            await self._wait_up(new_ws)
        except (OSError, RuntimeError) as e:
            log.error("reload failed (%s): the old workers keep serving", e)
            self.reload_error = f"new workers did not start: {e}"
            for w in new_ws:
                w.draining = True
                with contextlib.suppress(ProcessLookupError):
                    w.proc.kill()
            return
        self.generation = gen
        self.reloads += 1
        self.reload_error = None
        targets = [w.handover for w in new_ws] if self.cfg.handover_on_reload else []
        for i, w in enumerate(old):
            w.draining = True
            msg = DrainMsg(t="drain", timeout=self.cfg.request_timeout_s, why="reload")
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

    # -- metrics: one gateway -----------------------------------------------------------------
    async def merged_metrics(self) -> str:
        """Every worker's exposition merged with the main process's. All workers are asked at
        once; one that does not answer within METRICS_WAIT_S (a stopped or starved process)
        is represented by its last answer, so a scrape never shows a counter going back."""
        asks = []
        for w in list(self.workers):
            k = next(self._ids)
            fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
            self._asked[k] = (fut, w.row)
            w.send(MetricsAsk(t="metrics", id=k))
            asks.append((k, fut, w))
        if asks:
            await asyncio.wait([f for _, f, _ in asks], timeout=METRICS_WAIT_S)
        texts, late = [], 0
        for k, fut, w in asks:
            self._asked.pop(k, None)
            if fut.done() and fut.result():
                texts.append(fut.result())
                if w.late:
                    w.late = False
                    log.info("worker pid %d answers /metrics again", w.proc.pid)
                continue
            if not fut.done():
                late += 1
                if not w.late:
                    w.late = True
                    log.warning(
                        "worker pid %d did not answer /metrics within %.0f s: its last "
                        "exposition stands in",
                        w.proc.pid,
                        METRICS_WAIT_S,
                    )
            if w.last_metrics:  # "" once it exited: its counters are in the retired ones
                texts.append(w.last_metrics)
        self.metrics.late_workers.set(late)
        own = generate_latest(self.metrics.registry).decode()
        return merge_expositions(own, texts, self._retired_metrics)

    async def _answer_metrics(self, w: Worker, k: int) -> None:
        w.send(AggrMsg(t="aggr", id=k, text=await self.merged_metrics()))

    async def metrics_handler(self, request: web.Request) -> web.Response:
        text = await self.merged_metrics()
        return web.Response(body=text.encode(), headers={"Content-Type": CONTENT_TYPE_LATEST})

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
        await self.start_workers()  # after the admin API: once /health answers, so does it
        log.info(
            "gateway on http://%s:%d (%d workers), admin on http://%s:%d",
            cfg.host,
            self.port,
            self.n_workers,
            cfg.admin_host,
            self.admin_port,
        )


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=4096)
    sock.set_inheritable(True)
    return sock


def _take_or_listen(host: str, port: int) -> tuple[socket.socket, list[socket.socket]]:
    """The listening socket that orphaned workers of a killed main process still serve on
    (the very same accept queue, so a restart refuses nothing), or a new one; and the
    connections to those workers, to close once this process's workers serve."""
    sock, orphans = take_listener(port) if port else (None, [])
    if sock is None:
        for c in orphans:
            c.close()
        return _listen(host, port), []
    log.warning(
        "took the listening socket on port %d from %d worker(s) of a main process that died; "
        "they drain once this gateway's workers serve",
        port,
        len(orphans),
    )
    sock.set_inheritable(True)
    return sock, orphans


async def serve_main(
    cfg: GatewaySettings,
    admin_token: str | None,
    static: list[StaticEndpoint],
    warmup: bool,
    k8s: K8sSettings | None,
    *,
    workers: int,
    shutdown_timeout: float,
    reload_cfg: Callable[[], GatewaySettings] | None,
) -> None:
    token = resolve_token(admin_token)
    tmp = Path(tempfile.mkdtemp(prefix="unbroken-gateway-"))
    shared = SharedCounters(tmp / "admission", create=True)
    # Sized at start from the index bound; a reload keeps it (and its contents).
    prefix = PrefixTable(table_entries(cfg.prefix_index_blocks), path=tmp / "prefix", create=True)
    # The tenants' counts, shared by the workers (always made: a reload may add tenants).
    tenants = TenantTable(tmp / "tenants", create=True)
    listen, orphans = _take_or_listen(cfg.host, cfg.port)
    gw = MainGateway(cfg, token, shared, listen, tmp, workers, prefix, tenants)
    gw.took_over = bool(orphans)
    gw.shutdown_timeout = shutdown_timeout
    loop = asyncio.get_running_loop()
    # A SIGHUP during start-up (workers may already answer /health) is kept for after it,
    # not the default action, which would end the process.
    early: list[None] = []
    loop.add_signal_handler(signal.SIGHUP, early.append, None)
    try:
        try:
            await gw.start_main(static, warmup=warmup, k8s=k8s)
        except (OSError, RuntimeError):
            await gw.shutdown(0.0, asyncio.Event())
            await gw.stop()
            raise
        finally:
            for c in orphans:  # the old workers drain now (or, if this start failed, too)
                c.close()
        loop.call_later(UNREADY_WARNING_S, warn_unready, gw)
        tick = asyncio.create_task(gw._tick())
        stop, force = asyncio.Event(), asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, second_forces, stop, force)
        loop.add_signal_handler(signal.SIGHUP, gw.reload, reload_cfg)
        if early:
            gw.reload(reload_cfg)
        await stop.wait()
        log.info("gateway stopping: draining for up to %.0f s", shutdown_timeout)
        gw.closing = "shutting down"
        gw.broadcast()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(force.wait(), READINESS_LEAD_S)
        await gw.shutdown(shutdown_timeout, force)
        tick.cancel()
        await gw.stop()
    finally:
        with contextlib.suppress(OSError):
            listen.close()
        shared.close()
        prefix.close()
        if gw.proxy.limiter is None:  # else it lives as long as the limiter's views
            tenants.close()
        shutil.rmtree(tmp, ignore_errors=True)
