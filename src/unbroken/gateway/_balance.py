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

Under light load the workers pack instead (`pack_cpu`, `pack_conns`): the lowest-numbered
accepting worker whose CPU is under `pack_cpu` of a core and whose connections are under
`pack_conns` takes every new connection, its siblings leave each to it for `PACK_DEFER_S`.
Measured 2026-12-05 (docs/performance.md): two workers sharing 64 streams evenly spent 1.3x
one worker's CPU per relayed chunk (two Python processes woken by the same engine step each
take half its tokens per wake-up, and alternate on the cores with the engines and clients),
packed 1.04x; the demo's steady tail read the same either way. Past the thresholds the
spreading above takes over, so a worker that is busy hands new work to the others.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import math
import socket
import time

from aiohttp import web
from yarl import URL

from unbroken.gateway._shared import SharedCounters

__all__ = ["DEFER_S", "PACK_DEFER_S", "SLACK", "BalancedSite"]

log = logging.getLogger("unbroken.gateway.balance")

SLACK = 1  # connections over the least-loaded sibling before a new one is left to it
DEFER_S = 0.005  # how long it is left to the siblings
PACK_DEFER_S = 0.02  # how long a new connection is left to the packing worker
REFRESH_S = 0.5  # this worker's count is published at least this often
_BATCH = 64  # connections taken per wake-up at most
# Out of descriptors or memory (`_accept`).
_RESOURCE = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
ACCEPT_WARN_S = 30.0  # a descriptor shortage is warned of once per this, with its count


class BalancedSite(web.BaseSite):
    """An aiohttp site on a shared listening socket that accepts in proportion (module doc).
    Stopping it (a drain) closes this process's `sock`, as aiohttp's SockSite did (uvloop's
    server closes the socket it was given): once every worker's copy is closed the port
    refuses new connections at once instead of queueing them for nobody."""

    __slots__ = (
        "_cpu_at",
        "_failed",
        "_failed_said",
        "_listening",
        "_name",
        "_pack_conns",
        "_pack_cpu",
        "_refresh",
        "_shared",
        "_sock",
        "_tasks",
        "_wall_at",
    )

    def __init__(
        self,
        runner: web.BaseRunner,
        sock: socket.socket,
        shared: SharedCounters,
        *,
        pack_cpu: float | None = None,
        pack_conns: int = 512,
    ) -> None:
        super().__init__(runner)
        self._sock = sock
        self._sock.setblocking(False)
        host, port = self._sock.getsockname()[:2]
        self._name = str(URL.build(scheme="http", host=host, port=port))
        self._shared = shared
        # Packing off (None) or the CPU share under which this worker takes all new ones.
        self._pack_cpu = None if pack_cpu is None else int(pack_cpu * 1000)
        self._pack_conns = pack_conns
        self._cpu_at = time.process_time()
        self._wall_at = time.monotonic()
        self._listening = False
        self._refresh: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[object]] = set()
        # accept(2) failures for want of descriptors or memory since the last warning, and
        # when that was: one warning per ACCEPT_WARN_S, not one a second while it lasts.
        self._failed = 0
        self._failed_said = -math.inf

    @property
    def name(self) -> str:
        return self._name

    async def start(self) -> None:
        await super().start()
        self._listening = True
        self._shared.set_busy(0)  # idle so far: a packer from its first connection
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
        cpu, wall = time.process_time(), time.monotonic()
        if wall - self._wall_at >= REFRESH_S / 2:
            self._shared.set_busy(int(1000 * (cpu - self._cpu_at) / (wall - self._wall_at)))
            self._cpu_at, self._wall_at = cpu, wall
        if self._listening:
            loop = asyncio.get_running_loop()
            if self._refresh is not None:
                self._refresh.cancel()
            self._refresh = loop.call_later(REFRESH_S, self._publish)

    def _watch(self) -> None:
        if self._listening:
            asyncio.get_running_loop().add_reader(self._sock.fileno(), self._ready)

    def _pause(self, seconds: float, packer: int | None = None) -> None:
        """Leave what is waiting to the siblings for `seconds`, then take what is still
        waiting (a sibling that is busy, stalled, draining or dead delays a connection by
        `seconds` at most) and go back to watching. Left to a `packer` that has accepted
        since, nothing is taken then: what waits may have come a moment ago, and the packer
        is there to take it (each resume took a few of a ramp's connections otherwise)."""
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._sock.fileno())
        shared = self._shared
        before = -1 if packer is None else int(shared.conns[packer])

        def resume() -> None:
            if not self._listening:
                return
            if (packer is not None and shared.conns[packer] > before) or self._accept():
                self._watch()
            else:
                self._starved()

        loop.call_later(seconds, resume)

    def _starved(self) -> None:
        """Out of descriptors or memory (`_accept`): not watching for a second."""
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._sock.fileno())
        loop.call_later(1.0, self._watch)

    def _ready(self) -> None:
        mine = self._conns()
        shared = self._shared
        packer = None
        if self._pack_cpu is not None:
            packer = shared.packer(self._pack_cpu, self._pack_conns)
        if packer is not None:
            if packer != shared.row:
                shared.set_conns(mine, True)
                self._pause(PACK_DEFER_S, packer)
                return
        else:
            fewest = shared.fewest_conns_elsewhere()
            if fewest is not None and mine > fewest + SLACK:
                shared.set_conns(mine, True)
                self._pause(DEFER_S)
                return
        if not self._accept():
            self._starved()

    def _accept(self) -> bool:
        """Take what is waiting (up to `_BATCH`); False when the process is out of
        descriptors or memory (accept(2) keeps failing while the connection waits: the
        caller stops watching the socket for a second, as asyncio does, instead of spinning
        on it)."""
        loop = asyncio.get_running_loop()
        mine = self._conns()
        server = self._runner.server
        assert server is not None
        for _ in range(_BATCH):
            try:
                conn, _addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:
                if e.errno in _RESOURCE:
                    self._failed += 1
                    now = time.monotonic()
                    if now - self._failed_said >= ACCEPT_WARN_S:
                        log.warning(
                            "accept failed %d time(s) in the last %.0f s (%s): not accepting "
                            "for 1 s after each",
                            self._failed,
                            min(now - self._failed_said, ACCEPT_WARN_S),
                            e,
                        )
                        self._failed, self._failed_said = 0, now
                    return False
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
        return True

    def _adopted(self, task: asyncio.Task[object], conn: socket.socket) -> None:
        self._tasks.discard(task)
        if task.cancelled() or task.exception() is not None:
            log.debug("an accepted connection could not be served: %s", task)
            conn.close()  # a no-op where the transport took the descriptor over
