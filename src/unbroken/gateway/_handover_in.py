"""The new worker's side of a handover at a reload (`_handover.py` describes the whole
exchange): its handover socket (`Inbound`) takes a stream's client connection and state from
an old worker, and carries the stream on by continuation.

The adopted connection gets a small protocol (`AdoptedConn`) that notices the client going
away (the stream's task is cancelled, as aiohttp's handler would be, so the engine frees the
slot) and writes through an `AdoptedSink`. When the stream ends, the connection is given to
aiohttp's protocol and serves the client's next request, so a keep-alive client never sees it
close (unless the response said `Connection: close`).

Apart from the old worker's side because the two run in different processes and share only
the wire format, which is defined here (`HEAD`, the timeouts), with `HandoverHost`: what both
sides need of the worker. The old side imports this module, never the reverse.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
from typing import TYPE_CHECKING, Protocol

import orjson

from unbroken.gateway._messages import (
    SNAPSHOT_VERSION,
    HandedMsg,
    HandoverState,
    LeaseState,
    ToMain,
)
from unbroken.gateway._relay import AdoptedSink
from unbroken.gateway._stream import StreamRelay

if TYPE_CHECKING:
    from aiohttp import web

    from unbroken.config.spec import GatewaySettings
    from unbroken.gateway._pool import Pool
    from unbroken.gateway._proxy import Proxy
    from unbroken.gateway._ratelimit import Lease

__all__ = ["GO_TIMEOUT_S", "HEAD", "OFFER_TIMEOUT_S", "AdoptedConn", "HandoverHost", "Inbound"]

log = logging.getLogger("unbroken.gateway.handover")

OFFER_TIMEOUT_S = 3.0  # connect, send the state, get "R": else the stream stays
GO_TIMEOUT_S = 30.0  # a new worker that said "R" waits this long for "G"
HEAD = struct.Struct("!II")
_MAX_STATE = 64 * 2**20
_MAX_EARLY = 64 * 1024  # bytes of a client's next request buffered while its stream runs


class HandoverHost(Protocol):
    """What handing streams over needs of a worker (`_worker.WorkerGateway` is the one):
    its settings, endpoints and proxy, its count of requests being answered (its drain waits
    for them), its public server (an adopted connection serves its next request there), and
    its channel to the main process. An interface, so that this module and `_handover` need
    not import the worker, which imports them."""

    cfg: GatewaySettings
    pool: Pool
    proxy: Proxy
    runner: web.AppRunner | None
    inflight_requests: int
    accepting: bool

    @property
    def takes_streams(self) -> bool: ...

    def send(self, msg: ToMain) -> None: ...


class AdoptedConn(asyncio.Protocol):
    """An adopted client connection while its stream runs: flow control for the sink, and
    the client going away cancels the stream's task (the engine frees the request)."""

    def __init__(self, close: bool) -> None:
        self.close = close  # its response said `Connection: close`
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()  # the client's next request, should it send it early
        self.task: asyncio.Task[None] | None = None
        self.sink: AdoptedSink | None = None
        self.detached = False  # handed on (another worker, or aiohttp's protocol)
        self.lost = False
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if len(self.buf) > _MAX_EARLY and self.transport is not None:
            self.transport.pause_reading()

    def eof_received(self) -> bool | None:
        return None  # the client is gone: close, as aiohttp does

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def drained(self) -> None:
        if self._paused and not self.lost:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost = True
        self._wake()
        if self.detached or (self.sink is not None and self.sink.ended):
            return
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the client left: end the stream, free the engine's slot


class Inbound:
    """A new worker's handover socket: takes streams from old workers and carries them on."""

    def __init__(self, gw: HandoverHost, path: str) -> None:
        self.gw = gw
        self.path = path
        self.sock: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.adopted = 0

    def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(self.path)
        s.listen(256)
        s.setblocking(False)
        self.sock = s
        self._task = asyncio.create_task(self._accept())

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self.sock is not None:
            self.sock.close()
            with contextlib.suppress(OSError):
                os.unlink(self.path)

    async def _accept(self) -> None:
        assert self.sock is not None
        loop = asyncio.get_running_loop()
        while True:
            try:
                c, _ = await loop.sock_accept(self.sock)
            except OSError as e:
                log.warning("handover socket: %s", e)
                await asyncio.sleep(0.1)
                continue
            task = asyncio.create_task(self._take(c))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _take(self, c: socket.socket) -> None:
        gw = self.gw
        loop = asyncio.get_running_loop()
        fds: list[int] = []
        reserved = False
        try:
            c.setblocking(False)
            async with asyncio.timeout(OFFER_TIMEOUT_S):
                head, fds = await _recv_fds(loop, c, HEAD.size)
                head += await _recv_exactly(loop, c, HEAD.size - len(head))
                n_state, n_body = HEAD.unpack(head)
                if len(fds) != 1 or n_state > _MAX_STATE:
                    raise ValueError(f"{len(fds)} descriptor(s), state of {n_state} bytes")
                data = await _recv_exactly(loop, c, n_state + n_body)
            state: HandoverState = orjson.loads(data[:n_state])
            body = data[n_state:]
            if state.get("v") != SNAPSHOT_VERSION or not gw.takes_streams:
                c.send(b"N")
                return
            relay = StreamRelay.restore(gw.proxy, state, body)
            relay.failed = [e for n in state["failed"] if (e := gw.pool.get(n)) is not None]
            close = bool(state.get("close"))
            gw.inflight_requests += 1  # the drain of this worker waits for it from now on
            reserved = True
            c.send(b"R")
            async with asyncio.timeout(GO_TIMEOUT_S):
                go = await loop.sock_recv(c, 1)
            if go != b"G":
                return  # the old worker keeps it
            fd = fds.pop()
            reserved = False
        except (OSError, TimeoutError, ValueError, KeyError, TypeError) as e:  # JSON: ValueError
            log.warning("handover refused: %s: %s", type(e).__name__, e)
            return
        finally:
            for other in fds:
                os.close(other)  # a copy: the connection stays open in the old worker
            if reserved:
                gw.inflight_requests -= 1
            c.close()
        try:
            await self._adopt(fd, relay, close, state.get("lease"))
        except Exception:  # committed: the old worker has let go, so this stream is lost
            log.exception("could not adopt handed-over stream %s", relay.tracker.id)

    async def _adopt(
        self, fd: int, relay: StreamRelay, close: bool, lease: LeaseState | None = None
    ) -> None:
        """The connection is this worker's now (inflight_requests counts it)."""
        gw = self.gw
        loop = asyncio.get_running_loop()
        conn = AdoptedConn(close)
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            os.close(fd)
            gw.inflight_requests -= 1
            raise
        try:
            t, _ = await loop.connect_accepted_socket(lambda: conn, sock)
        except BaseException:
            sock.close()
            gw.inflight_requests -= 1
            raise
        sink = AdoptedSink(
            t,  # type: ignore[arg-type]
            gw.cfg.stream_buffer_bytes,
            gw.proxy.buffer_budget,
            conn.drained,
            lambda: self._keep_serving(conn),
        )
        conn.sink = sink
        gw.proxy.sinks.add(sink)
        self.adopted += 1
        gw.send(HandedMsg(t="handed", dir="in"))
        tenant = gw.proxy.tenancy.adopted(relay, lease)  # its tenant's count comes along
        conn.task = asyncio.create_task(self._carry_on(relay, sink, tenant))
        if conn.lost:
            conn.task.cancel()

    async def _carry_on(
        self, relay: StreamRelay, sink: AdoptedSink, lease: Lease | None = None
    ) -> None:
        try:
            await relay.resume(sink)
        except asyncio.CancelledError:
            pass  # the client left (counted by the relay)
        except Exception:
            log.exception("handed-over stream %s failed", relay.tracker.id)
            sink.abort()
        finally:
            self.gw.proxy.tenancy.adopted_end(relay, lease)
            self.gw.inflight_requests -= 1

    def _keep_serving(self, conn: AdoptedConn) -> None:
        """The adopted stream is complete: the connection serves the client's next request
        here (aiohttp's protocol takes it over), unless its response said it would close."""
        t = conn.transport
        assert t is not None
        server = self.gw.runner.server if self.gw.runner is not None else None
        if conn.close or server is None or not self.gw.accepting or t.is_closing():
            t.close()  # after what is buffered
            return
        conn.detached = True
        h = server()
        t.set_protocol(h)
        h.connection_made(t)
        if conn.buf:
            h.data_received(bytes(conn.buf))
        if not t.is_reading():
            t.resume_reading()


async def _recv_fds(
    loop: asyncio.AbstractEventLoop, s: socket.socket, n: int
) -> tuple[bytes, list[int]]:
    """Up to `n` bytes and the descriptors that came with them."""
    while True:
        try:
            data, fds, _flags, _ = socket.recv_fds(s, n, 1)
        except BlockingIOError:
            fut: asyncio.Future[None] = loop.create_future()
            loop.add_reader(s.fileno(), _ready, fut)
            try:
                await fut
            finally:
                loop.remove_reader(s.fileno())
            continue
        if not data and not fds:
            raise ConnectionResetError("closed before the offer")
        return data, list(fds)


def _ready(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


async def _recv_exactly(loop: asyncio.AbstractEventLoop, s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = await loop.sock_recv(s, min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionResetError("closed in the middle of the offer")
        buf += chunk
    return bytes(buf)
