"""The main process's worker processes (`--workers N`): started on the shared listening
socket, listened to on their control sockets, replaced when one dies, asked for their
metrics (one /metrics for the whole gateway), and what `unbroken_gateway_workers` shows.

`WorkerProcesses` is the layer of `_main_gateway.MainGateway` that deals with processes; the
state they serve from (endpoint columns, snapshots, reloads) is the layer above. Apart so
that each reads alone: this one knows how a worker is started, heard and lost, and nothing
of what the state means.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from unbroken.gateway._messages import (
    AggrMsg,
    MetricsAsk,
    ModelsMsg,
    StateMsg,
    ToMain,
    ToWorker,
    WorkerSpec,
    decode,
    encode,
)
from unbroken.gateway._metrics import merge_expositions, retire
from unbroken.gateway._prefix_table import PrefixTable
from unbroken.gateway._server import Gateway
from unbroken.gateway._shared import MAX_WORKERS, SharedCounters
from unbroken.gateway._tenant_table import TenantTable
from unbroken.wire.exposition import render_text

__all__ = ["Worker", "WorkerGauge", "WorkerProcesses"]

log = logging.getLogger("unbroken.gateway.main")

START_TIMEOUT_S = 30.0  # a new worker must serve within this, or the reload is abandoned
# A worker that dies within QUICK_DEATH_S of its start most likely cannot start (broken
# settings or code): the second such death in a row is a crash loop, and each replacement
# after it waits twice as long as the one before (BACKOFF_FIRST_S, up to BACKOFF_MAX_S).
QUICK_DEATH_S = 10.0
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0
METRICS_WAIT_S = 2.0  # a /metrics scrape waits this long for the workers' expositions


@dataclass(eq=False)
class Worker:
    proc: asyncio.subprocess.Process
    row: int
    generation: int
    writer: asyncio.StreamWriter
    handover: str = ""  # its handover socket (streams of old workers come in there)
    up: asyncio.Event = field(default_factory=asyncio.Event)
    started: float = field(default_factory=time.monotonic)
    draining: bool = False
    acked: int = -1  # the last state message it applied
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    # Its latest /metrics exposition: stands in for it while it is late to answer, and is
    # what of its counters outlives it.
    last_metrics: str = ""
    late: bool = False
    reading: asyncio.Task[None] | None = None  # its control socket's reader

    @property
    def serving(self) -> bool:
        """Said it serves (`up`), and not told to drain."""
        return self.up.is_set() and not self.draining

    @property
    def starting(self) -> bool:
        """Not yet said it serves, and not told to drain."""
        return not self.up.is_set() and not self.draining

    def send(self, msg: ToWorker) -> None:
        if not self.writer.is_closing():
            self.writer.write(encode(msg))

    def run(self, coro: Coroutine[Any, Any, None]) -> None:
        """An answer to this worker, as a task of its own (kept until it ends)."""
        task = asyncio.create_task(coro)
        self.tasks.append(task)
        task.add_done_callback(self.tasks.remove)


async def _up_or_exit(w: Worker, timeout: float | None = None) -> bool:
    """Wait until `w` says it serves, exits, or `timeout` passes: whether it said it serves
    first."""
    up = asyncio.ensure_future(w.up.wait())
    ended = asyncio.ensure_future(w.proc.wait())
    done, _ = await asyncio.wait([up, ended], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    up.cancel()
    ended.cancel()
    return up in done


class WorkerGauge(Collector):
    """The workers by state, and their restarts. `main` None: a gateway of one process
    (`--workers 1`), which serves itself and is never restarted or reloaded, exports the
    same series (an alert on `unbroken_gateway_workers{state="serving"} < 1` reads the same
    whatever the worker count)."""

    def __init__(self, main: WorkerProcesses | None) -> None:
        self.main = main

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        g = GaugeMetricFamily(
            "unbroken_gateway_workers",
            "Worker processes: serving, and old ones still finishing their streams after a "
            "reload or during shutdown.",
            labels=["state"],
        )
        main = self.main
        ws = main.workers if main is not None else []
        serving = sum(w.serving for w in ws) if main is not None else 1
        g.add_metric(["serving"], serving)
        g.add_metric(["starting"], sum(w.starting for w in ws))
        g.add_metric(["draining"], sum(w.draining for w in ws))
        r = CounterMetricFamily(
            "unbroken_gateway_worker_restarts",
            "Workers that died and were replaced, and reloads done, since start.",
            labels=["kind"],
        )
        r.add_metric(["replaced"], main.replaced if main is not None else 0)
        r.add_metric(["reload"], main.reloads if main is not None else 0)
        yield from (g, r)


class WorkerProcesses(Gateway):
    """The worker processes of the main process (module doc). Its state is set by
    `MainGateway.__init__`; what it reads of the layer above is `snapshot`."""

    shared: SharedCounters
    prefix_table: PrefixTable | None
    tenant_table: TenantTable | None
    tenant_slots: dict[str, int]
    listen: socket.socket
    tmp: Path
    n_workers: int
    shutdown_timeout: float  # what a worker allows its streams if this process dies
    workers: list[Worker]
    generation: int  # of the workers serving now (a reload starts the next)
    replaced: int  # workers that died and were replaced
    reloads: int
    stopping: bool
    _quick_deaths: int  # workers dead within QUICK_DEATH_S of their start, in a row
    _free_rows: list[int]
    _ids: Iterator[int]
    _asked: dict[int, tuple[asyncio.Future[str], int]]  # /metrics asks, by id: (answer, row)
    _retired_metrics: str  # counters of workers that have exited (reloads, deaths)

    def snapshot(self) -> StateMsg:
        """The state a new worker starts from (`MainGateway.snapshot`)."""
        raise NotImplementedError

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
                        if why := msg.get("why"):
                            ep.note_error(why)  # the worker's failure, for the log and admin
                        self.prober.suspect(ep)
                elif t == "metrics":
                    w.last_metrics = msg["text"]  # a late answer still updates the stand-in
                    got = self._asked.get(msg["id"])
                    if got is not None and not got[0].done():
                        got[0].set_result(msg["text"])
                elif t == "handed":
                    self.metrics.handed_over.labels(msg["dir"]).inc()
                elif t == "aggr?":
                    w.run(self._answer_metrics(w, msg["id"]))
                elif t == "models?":
                    w.run(self._answer_models(w, msg["id"]))

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
        if w.generation != self.generation:
            # A reload's new worker, dead before the reload took over: the reload sees it
            # (`_wait_up`) and is abandoned; replacing it would start its settings again.
            log.error(
                "worker pid %d of generation %d (a reload's) died (exit %s) before the reload "
                "took over; not replaced",
                w.proc.pid,
                w.generation,
                code,
            )
            return
        await self._replace(w, code)

    async def _replace(self, w: Worker, code: int) -> None:
        """A new worker for one that died. Deaths within QUICK_DEATH_S of the start, in a
        row, are a crash loop: replaced after a growing back-off, logged once per episode."""
        lived = time.monotonic() - w.started
        self._quick_deaths = self._quick_deaths + 1 if lived < QUICK_DEATH_S else 0
        n = self._quick_deaths
        delay = 0.0 if n <= 1 else min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (n - 2))
        if n <= 1:
            log.error("worker pid %d died (exit %s): replacing it", w.proc.pid, code)
        elif n == 2:
            log.error(
                "worker pid %d died (exit %s) %.1f s after its start, as the one before it: "
                "the workers are crash-looping; each replacement waits longer (up to %.0f s); "
                "not logged again until a worker has served %.0f s",
                w.proc.pid,
                code,
                lived,
                BACKOFF_MAX_S,
                QUICK_DEATH_S,
            )
        else:
            log.debug(
                "worker pid %d died (exit %s): replacing it in %.1f s", w.proc.pid, code, delay
            )
        if delay:
            await asyncio.sleep(delay)
        while not self.stopping and w.generation == self.generation:
            try:
                new = await self.spawn(w.generation)
            except (OSError, RuntimeError) as e:
                log.error("cannot start a worker: %s; retrying", e)
                await asyncio.sleep(max(1.0, delay))
                continue
            self.replaced += 1
            if n:
                new.run(self._settled(new))
            return

    async def _settled(self, w: Worker) -> None:
        """A crash loop ends when a replacement has served QUICK_DEATH_S."""
        if not await _up_or_exit(w):
            return  # it died first: its death counts
        await asyncio.sleep(QUICK_DEATH_S)
        if w.proc.returncode is None and self._quick_deaths:
            looping, self._quick_deaths = self._quick_deaths >= 2, 0
            if looping:
                log.info(
                    "worker pid %d has served %.0f s: workers start again",
                    w.proc.pid,
                    QUICK_DEATH_S,
                )

    async def start_workers(self) -> None:
        ws = [await self.spawn(self.generation) for _ in range(self.n_workers)]
        await self._wait_up(ws)

    async def _wait_up(self, ws: list[Worker]) -> None:
        async def one(w: Worker) -> None:
            if not await _up_or_exit(w, START_TIMEOUT_S):
                raise RuntimeError(f"worker pid {w.proc.pid} did not start serving")

        await asyncio.gather(*(one(w) for w in ws))

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
        own = render_text(self.metrics.registry).decode()
        return merge_expositions(own, texts, self._retired_metrics)

    async def _answer_models(self, w: Worker, k: int) -> None:
        """A worker met a model no endpoint is known to serve: read the engines' models,
        send every worker the state, then answer (after the state, on the same socket)."""
        await self.read_models()
        self.broadcast()
        w.send(ModelsMsg(t="models", id=k))

    def broadcast(self) -> None:
        """The state to every worker (`MainGateway.broadcast`)."""
        raise NotImplementedError

    async def _answer_metrics(self, w: Worker, k: int) -> None:
        w.send(AggrMsg(t="aggr", id=k, text=await self.merged_metrics()))

    async def metrics_handler(self, request: web.Request) -> web.Response:
        text = await self.merged_metrics()
        return web.Response(body=text.encode(), headers={"Content-Type": CONTENT_TYPE_LATEST})
