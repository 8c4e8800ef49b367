"""Accepts balanced across the gateway's workers.

The workers share one listening socket, inherited from the main process, so that a reload's
new workers take connections while the old ones drain and no connection waiting in the
accept queue is lost. On it the kernel wakes every worker for each new connection and the
first to run takes it, and clients keep their connections (keep-alive, one per streaming
user): measured 2026-12-05, the demo's 200 users ended 156 / 44 on two workers (the busier
one at ~25 % of a core against ~10 %, and the requests it took waited longer for it), 60
users of one engine 40 / 20 and 39 / 21.

So a worker holding more client connections than the least-loaded other accepting worker
(by more than `SLACK`) leaves a new connection to it for `DEFER_S`, then takes whatever is
still waiting: a sibling that is busy, stalled, draining or dead delays a connection by
`DEFER_S` at most. The counts are in the workers' shared table (`SharedCounters.conns`,
refreshed at each accept and every `REFRESH_S`). SO_REUSEPORT would spread connections by
hash instead, but it gives each worker its own accept queue, which a reload would drop.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket

from aiohttp import web
from yarl import URL

from unbroken.gateway._shared import SharedCounters

__all__ = ["DEFER_S", "SLACK", "BalancedSite"]

log = logging.getLogger("unbroken.gateway.balance")

SLACK = 1  # connections over the least-loaded sibling before a new one is left to it
DEFER_S = 0.005  # how long it is left to the siblings
REFRESH_S = 0.5  # this worker's count is published at least this often
_BATCH = 64  # connections taken per wake-up at most
# Out of descriptors or memory: accept(2) keeps failing while the connection waits, so stop
# watching the socket for a second (as asyncio does) instead of spinning on it.
_RESOURCE = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


class BalancedSite(web.BaseSite):
    """An aiohttp site on a shared listening socket that accepts in proportion (module doc).
    Stopping it (a drain) closes this process's `sock`, as aiohttp's SockSite did (uvloop's
    server closes the socket it was given): once every worker's copy is closed the port
    refuses new connections at once instead of queueing them for nobody."""

    __slots__ = ("_force_until", "_listening", "_name", "_refresh", "_shared", "_sock", "_tasks")

    def __init__(self, runner: web.BaseRunner, sock: socket.socket, shared: SharedCounters) -> None:
        super().__init__(runner)
        self._sock = sock
        self._sock.setblocking(False)
        host, port = self._sock.getsockname()[:2]
        self._name = str(URL.build(scheme="http", host=host, port=port))
        self._shared = shared
        self._force_until = 0.0
        self._listening = False
        self._refresh: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[object]] = set()

    @property
    def name(self) -> str:
        return self._name

    async def start(self) -> None:
        await super().start()
        self._listening = True
        self._watch()
        self._publish()

    async def stop(self) -> None:
        if self._listening:
            self._listening = False
            loop = asyncio.get_running_loop()
            loop.remove_reader(self._sock.fileno())
            if self._refresh is not None:
                self._refresh.cancel()
            self._publish()
            self._sock.close()
        await super().stop()

    # -- accepting ----------------------------------------------------------------------------
    def _conns(self) -> int:
        return len(getattr(self._runner.server, "_connections", ()))

    def _publish(self) -> None:
        self._shared.set_conns(self._conns(), self._listening)
        if self._listening:
            loop = asyncio.get_running_loop()
            if self._refresh is not None:
                self._refresh.cancel()
            self._refresh = loop.call_later(REFRESH_S, self._publish)

    def _watch(self) -> None:
        if self._listening:
            asyncio.get_running_loop().add_reader(self._sock.fileno(), self._ready)

    def _pause(self, seconds: float, *, force: bool) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._sock.fileno())

        def resume() -> None:
            if force:
                self._force_until = loop.time() + seconds
            self._watch()

        loop.call_later(seconds, resume)

    def _ready(self) -> None:
        loop = asyncio.get_running_loop()
        mine = self._conns()
        if loop.time() >= self._force_until:
            fewest = self._shared.fewest_conns_elsewhere()
            if fewest is not None and mine > fewest + SLACK:
                self._shared.set_conns(mine, True)
                self._pause(DEFER_S, force=True)
                return
        server = self._runner.server
        assert server is not None
        for _ in range(_BATCH):
            try:
                conn, _addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:
                if e.errno in _RESOURCE:
                    log.warning("accept failed (%s): not accepting for 1 s", e)
                    self._pause(1.0, force=False)
                    return
                break  # the client gave up before it was accepted (ECONNABORTED): next
            try:
                conn.setblocking(False)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:  # reset before it was set up: the client is gone
                conn.close()
                continue
            task = loop.create_task(loop.connect_accepted_socket(server, sock=conn))
            self._tasks.add(task)
            task.add_done_callback(lambda t, c=conn: self._adopted(t, c))
            mine += 1
        self._shared.set_conns(mine, True)

    def _adopted(self, task: asyncio.Task[object], conn: socket.socket) -> None:
        self._tasks.discard(task)
        if task.cancelled() or task.exception() is not None:
            log.debug("an accepted connection could not be served: %s", task)
            conn.close()  # a no-op where the transport took the descriptor over
