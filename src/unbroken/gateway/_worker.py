"""A gateway worker process: serves the public routes on the listening socket it inherited
from the main process (`_main.py`), with admission in the shared table (`_shared.py`).

It learns endpoints, caps and routes from the main process's state messages over its control
socket and runs no prober, discovery or admin API of its own. The messages both ways, and
their codec, are typed in `_messages`.

A drain (reload or shutdown) closes this worker's copy of the listener, lets each connection
finish its current request, and exits 0; `force` ends the streams still open with an SSE
error event. At a reload the streams go to the new workers instead, with their connections
(`_handover`), so the drain takes seconds.

A lost control socket (or the kernel's parent-death signal) means the main process died
(kill -9, a crash): the worker keeps serving on the listening socket, with the endpoints and
caps it last heard of, and offers that socket to the next main process (`offer_listener`).
Once one takes it (the supervisor's restart, on the same port), the worker drains: its
streams finish (up to `--shutdown-timeout`) and it exits. No new main process within
`--shutdown-timeout`: it drains all the same (the port closes once the workers exit).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from unbroken.config.spec import GatewaySettings
from unbroken.gateway._balance import BalancedSite
from unbroken.gateway._handover import Inbound, Outbound, offer_listener
from unbroken.gateway._messages import (
    AckMsg,
    AggrAsk,
    MetricsMsg,
    ModelsAsk,
    StateMsg,
    SuspectMsg,
    ToMain,
    ToWorker,
    UpMsg,
    WorkerSpec,
    apply_endpoint,
    decode,
    encode,
)
from unbroken.gateway._pool import Endpoint, State
from unbroken.gateway._prefix_table import PrefixTable
from unbroken.gateway._ratelimit import TenantTable
from unbroken.gateway._server import Gateway
from unbroken.gateway._shared import SharedCounters, SharedSlot
from unbroken.wire.errors import ApiError
from unbroken.wire.exposition import render_text
from unbroken.wire.heap import freeze_startup_heap
from unbroken.wire.http import ServerLimits, client_session, start_site

__all__ = ["WorkerGateway", "main"]

MERGE_WAIT_S = 5.0  # a /metrics scrape waits this long for the main process's merge
TERM_SETTLE_S = 0.2  # a SIGTERM is told from the parent-death signal after this

log = logging.getLogger("unbroken.gateway.worker")


class WorkerGateway(Gateway):
    def __init__(
        self,
        cfg: GatewaySettings,
        shared: SharedCounters,
        writer: Any,
        prefix_table: PrefixTable | None = None,
        tenant_table: TenantTable | None = None,
        tenant_slots: dict[str, int] | None = None,
    ) -> None:
        super().__init__(cfg, "", shared, prefix_table, tenant_table, tenant_slots)
        self.shared = shared
        self.writer: asyncio.StreamWriter = writer
        self._ids = itertools.count()
        self._asked: dict[int, asyncio.Future[str]] = {}
        self.force = asyncio.Event()
        self.drain_task: asyncio.Task[None] | None = None
        # Set when `drain_task` is: the worker's main coroutine waits on it (a 20 Hz poll
        # cost each idle worker ~1.3 ms of CPU a second).
        self.drain_started = asyncio.Event()
        self.runner: web.AppRunner | None = None
        self.shutdown_timeout = 30.0
        self.inbound: Inbound | None = None  # streams handed over by old workers
        self.outbound: Outbound | None = None  # this worker's streams, at a reload
        self.accepting = True  # takes handed-over streams (until its drain is over)
        self.listen: socket.socket | None = None
        self.orphaned = False  # the main process died; serving until a new one takes over
        self._offer: asyncio.Task[None] | None = None
        self.listener_given = False  # a new main process has the listening socket

    def send(self, msg: ToMain) -> None:
        if not self.writer.is_closing():
            self.writer.write(encode(msg))

    def _after_release(self, ep: Endpoint) -> None:
        """Drained endpoints are removed by the main process, which sees all workers."""

    # -- state from the main process -----------------------------------------------------------
    def apply(self, snap: StateMsg) -> None:
        """A state message from the main process (`_messages.state_message`) made live."""
        pool = self.pool
        pool.default_cap = snap["default_cap"]
        pool.routes = snap["routes"]
        pool.routes_override = snap["routes_override"]
        pool.pool_order = snap["pool_order"]
        if self.proxy.limiter is not None and "replicas" in snap:
            self.proxy.limiter.replicas, self.proxy.limiter.rank = snap["replicas"]
        if snap.get("closing"):
            self.closing = snap["closing"]
        seen = set()
        for d in snap["endpoints"]:
            name = d["name"]
            seen.add(name)
            ep = pool.get(name)
            if ep is None or getattr(ep.slot, "col", None) != d["col"]:
                if ep is not None:
                    pool.remove(name)
                ep = Endpoint(
                    name=name,
                    url=d["url"],
                    pool=d["pool"],
                    warmup=False,
                    slot=SharedSlot(self.shared, d["col"]),
                )
                pool.add(ep)
            apply_endpoint(ep, d)
            if ep.state == State.DRAINING and d["deadline"] is not None:
                if name not in self._drain_timers:  # the stream migration at the deadline
                    ep.drain_deadline = time.monotonic() + d["deadline"]
                    self._drain_timers[name] = asyncio.get_running_loop().call_later(
                        d["deadline"], self._drain_deadline, ep
                    )
            elif (h := self._drain_timers.pop(name, None)) is not None:
                h.cancel()
        for name in [n for n in pool.endpoints if n not in seen]:
            pool.remove(name)  # streams still on it finish; their slots go back all the same
            if (h := self._drain_timers.pop(name, None)) is not None:
                h.cancel()
        self.admission.wake()

    # -- /metrics: one gateway, all workers merged by the main process -------------------------
    async def _ask(self, msg: ToMain, k: int, timeout: float | None = None) -> str:
        """Send the main process `msg` (asking under id `k`) and wait for its answer."""
        fut = self._asked[k] = asyncio.get_running_loop().create_future()
        self.send(msg)
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._asked.pop(k, None)

    def _answered(self, k: int, text: str) -> None:
        fut = self._asked.get(k)
        if fut is not None and not fut.done():
            fut.set_result(text)

    async def metrics_handler(self, request: web.Request) -> web.Response:
        k = next(self._ids)
        try:
            text = await self._ask(AggrAsk(t="aggr?", id=k), k, MERGE_WAIT_S)
        except TimeoutError:
            # This worker's counters alone would read as a reset of the others': fail the
            # scrape instead (Prometheus records it as down and keeps the series intact).
            raise ApiError(
                503,
                "metrics unavailable: the gateway's main process did not merge the workers' "
                f"expositions within {MERGE_WAIT_S:g} s",
                type="service_unavailable",
            ) from None
        return web.Response(body=text.encode(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _ask_models(self) -> None:
        """The main process reads the engines' models again; its answer follows the state
        that has them (one socket, in order), so they are applied here when it comes."""
        k = next(self._ids)
        await self._ask(ModelsAsk(t="models?", id=k), k)

    def send_metrics(self, k: int) -> None:
        """This worker's exposition to the main process, which merges every worker's."""
        self.send(MetricsMsg(t="metrics", id=k, text=render_text(self.metrics.registry).decode()))

    async def start_worker(self, listen: socket.socket) -> None:
        cfg = self.cfg
        self.proxy.session = client_session(connect_timeout=cfg.connect_timeout_s)
        self.proxy.on_hang = lambda ep: self.send(
            SuspectMsg(t="suspect", name=ep.name, why=ep.last_error)
        )
        self.proxy.read_models = self._ask_models
        limits = ServerLimits(cfg.header_timeout_s, cfg.max_connections_per_client)
        freeze_startup_heap()
        shared = self.shared
        self.runner = await start_site(
            self.public_app(),
            cfg.host,
            cfg.port,
            limits=limits,
            site_for=lambda runner: BalancedSite(
                runner,
                listen,
                shared,
                pack_cpu=cfg.accept_pack_cpu or None,
                pack_conns=cfg.accept_pack_conns,
            ),
        )
        self._runners = [self.runner]
        # Its records go to the other replicas; the main process (its parent, whose pid
        # names this replica) records theirs into the shared table.
        await self.start_share(publish=True, subscribe=False, owner_pid=os.getppid())

    @property
    def takes_streams(self) -> bool:
        """Whether streams handed over by old workers are taken (not once shutting down)."""
        return self.accepting and self.closing is None and not self.force.is_set()

    def start_handover(self, path: str) -> None:
        self.inbound = Inbound(self, path)
        self.inbound.start()

    def drain(self, timeout: float, why: str, handover: list[str] | None = None) -> None:
        if self.drain_task is None:
            self.drain_task = asyncio.create_task(self._drain(timeout, why))
            self.drain_started.set()
        if handover and self.outbound is None:
            self.outbound = Outbound(self, handover)
            self.outbound.start()

    async def _drain(self, timeout: float, why: str) -> None:
        assert self.runner is not None
        try:
            ended = await self.drain_public(self.runner, timeout, self.force, why)
        finally:
            # No await since the drain saw nothing in flight: no stream can come in after it.
            self.accepting = False
            if self.outbound is not None:
                self.outbound.stop()
        if self.inbound is not None:
            self.inbound.close()
        log.info("worker %d drained (%s); %d stream(s) ended", os.getpid(), why, ended)
        await self.stop()

    async def control(self, reader: asyncio.StreamReader) -> None:
        while line := await reader.readline():
            msg: ToWorker = decode(line)
            t = msg["t"]
            if t == "state":
                self.apply(msg)
                self.send(AckMsg(t="ack", seq=msg["seq"]))
            elif t == "metrics":
                self.send_metrics(msg["id"])
            elif t == "aggr":
                self._answered(msg["id"], msg["text"])
            elif t == "models":
                self._answered(msg["id"], "")
            elif t == "rebalance":
                ep = self.pool.get(msg["endpoint"])
                if ep is not None:
                    self.rebalance(ep, msg["priorities"], msg["batch"], msg["every_s"])
            elif t == "drain":
                self.drain(msg["timeout"], msg["why"], msg.get("handover"))
            elif t == "force":
                self.force.set()
        self.lost_main()

    def lost_main(self) -> None:
        """The main process is gone (its end of the control socket closed, or the kernel's
        parent-death signal; either may come first, and both come). Closing the listener
        now would refuse every connection until a new main binds the port, and forcing
        the drain would cut every stream: keep serving and offer the listening socket to
        the next main process instead; drain once it serves (or after the shutdown timeout)."""
        if self.orphaned or self.drain_task is not None:
            return  # told already, or draining anyway (a reload's or shutdown's drain goes on)
        self.orphaned = True
        if self.listen is None:
            self._drain_orphan("main process gone")
            return
        wait = self.shutdown_timeout
        log.warning(
            "worker %d lost the main process: serving on until a new one takes the listening "
            "socket (at most %.0f s, the shutdown timeout)",
            os.getpid(),
            wait,
        )
        port = int(self.listen.getsockname()[1])
        self._offer = asyncio.create_task(
            offer_listener(
                self.listen,
                port,
                self._given,
                lambda: self._drain_orphan("a new main process took over"),
            )
        )
        asyncio.get_running_loop().call_later(
            wait, self._drain_orphan, "main process gone, and no new one came", True
        )

    def _given(self) -> None:
        self.listener_given = True  # the new main process says when to drain (bounded)

    def _drain_orphan(self, why: str, timer: bool = False) -> None:
        if self.drain_task is not None or (timer and self.listener_given):
            return
        if self._offer is not None and not self._offer.done():
            self._offer.cancel()
        log.warning("worker %d: %s; draining", os.getpid(), why)
        self.closing = "the gateway's main process is gone"
        self.drain(self.shutdown_timeout, why)


async def _run(spec: WorkerSpec) -> None:
    cfg = GatewaySettings.model_validate_json(Path(spec["cfg"]).read_text())
    shared = SharedCounters(Path(spec["shm"]), row=spec["row"])
    # The prefix index all workers share (its columns are the admission table's).
    prefix = PrefixTable(path=Path(spec["prefix"])) if spec.get("prefix") else None
    ctl = socket.socket(fileno=spec["ctl_fd"])
    reader, writer = await asyncio.open_unix_connection(sock=ctl, limit=64 * 2**20)
    # The tenants' counts all workers share, and each tenant's slot in them (by name).
    ten = spec.get("tenants")
    table = TenantTable(Path(ten["path"]), row=spec["row"]) if ten else None
    gw = WorkerGateway(cfg, shared, writer, prefix, table, ten["slots"] if ten else None)
    gw.shutdown_timeout = spec["shutdown_timeout"]
    listen = socket.socket(fileno=spec["listen_fd"])
    gw.listen = listen
    # The first state arrives before we serve, so the first request finds the endpoints.
    first: StateMsg = decode(await reader.readline())
    gw.apply(first)
    await gw.start_worker(listen)
    if spec.get("handover"):
        gw.start_handover(spec["handover"])
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, lambda: None)  # Ctrl-C: the main process decides

    def decide() -> None:
        if gw.orphaned or os.getppid() != spec["main_pid"]:
            # The kernel's parent-death signal (PR_SET_PDEATHSIG): the main process died. It
            # is not a second SIGTERM, so it must never force a drain already under way.
            gw.lost_main()
        elif gw.drain_task is not None:  # a second SIGTERM from someone: end what is left
            gw.force.set()
        else:
            gw.closing = "shutting down"
            gw.drain(gw.shutdown_timeout, "SIGTERM")

    def on_term() -> None:
        # The parent-death signal comes when the thread that started this worker exits,
        # while the main process's other threads may still live: getppid() still names it
        # then. Decide once its death is complete (the control socket's EOF, reparenting).
        loop.call_later(TERM_SETTLE_S, decide)

    loop.add_signal_handler(signal.SIGTERM, on_term)
    control = asyncio.create_task(gw.control(reader))
    gw.send(UpMsg(t="up", pid=os.getpid()))
    await writer.drain()
    await gw.drain_started.wait()
    assert gw.drain_task is not None
    await gw.drain_task
    # The last word: what this worker counted, so the main process keeps it after the exit.
    gw.send_metrics(-1)
    with contextlib.suppress(ConnectionError, TimeoutError):  # a stopped main: exit anyway
        await asyncio.wait_for(writer.drain(), 2.0)
    control.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await control


def _die_with_parent(main_pid: int) -> None:
    """SIGTERM to this worker when the main process dies, however it dies (SIGKILL too)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != main_pid:  # it died before the line above
        os.kill(os.getpid(), signal.SIGTERM)


def main() -> None:
    spec: WorkerSpec = decode(os.environ["UNBROKEN_GW_WORKER"].encode())
    _die_with_parent(spec["main_pid"])
    logging.basicConfig(
        level=spec.get("log_level", logging.INFO),
        format=f"%(asctime)s %(levelname)s %(name)s[w{spec['row']}]: %(message)s",
        stream=sys.stderr,
    )
    import uvloop

    uvloop.run(_run(spec))


if __name__ == "__main__":
    main()
