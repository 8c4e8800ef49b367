"""Handing open streams, with their client connections, to the new workers at a reload.

Without this an old worker lives until its longest stream ends. With it (`handover_on_reload`,
on by default), once the new generation serves, the main process gives each old worker the
handover sockets of the new workers (round-robin), and the old worker moves every stream it
can: between two events it cuts the stream's leg (the engine frees the request), waits until
every byte relayed so far is in the kernel, and sends the client's socket (`SCM_RIGHTS`) with
the stream's state to a new worker, which continues it by continuation from an engine, as
after any other break (same id, no second role chunk, usage added up; byte-exact for greedy
decoding). The old worker then drops its copy of the socket without a byte or a FIN (the new
worker's copy keeps the connection open) and exits once nothing is left: seconds, not the
longest generation.

One Unix stream connection per stream, to the new worker's handover socket:

    old → new   8-byte header (state and body lengths) carrying the client's socket, then
                the state (JSON, `StreamRelay.snapshot`) and the request body
    new → old   b"R": it will carry the stream on (or b"N", or nothing: it will not)
    old → new   b"G": the old worker lets go of the connection now

The new worker writes nothing to the client before "G"; the old one nothing after sending
the state. Anything short of "G" leaves the stream with the old worker, which continues it
by continuation and finishes it there (the old behaviour for that stream); so do streams
that cannot be continued (`not_migratable`), whose client has data of a next request in
flight, or whose client has not drained what it was sent within FLUSH_TIMEOUT_S. A stream
that has not had its first event yet is handed once it has.

The new worker adopts the connection with a small protocol (`_Conn`) that notices the
client going away (the stream's task is cancelled, as aiohttp's handler would be, so the
engine frees the slot) and writes through an `AdoptedSink`. When the stream ends, the
connection is given to aiohttp's protocol and serves the client's next request, so a
keep-alive client never sees it close (unless the response said `Connection: close`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from unbroken.gateway._continuation import not_migratable
from unbroken.gateway._messages import SNAPSHOT_VERSION, HandedMsg, HandoverState, LeaseState
from unbroken.gateway._relay import AdoptedSink
from unbroken.gateway._stream import StreamRelay

if TYPE_CHECKING:
    from unbroken.gateway._ratelimit import Lease
    from unbroken.gateway._worker import WorkerGateway

__all__ = ["Inbound", "Outbound", "offer_listener", "take_listener", "takeover_dir"]

log = logging.getLogger("unbroken.gateway.handover")

SCAN_S = 0.05  # how often an old worker looks for streams it can hand over
FLUSH_TIMEOUT_S = 2.0  # a client must take what it was sent within this, else the stream stays
OFFER_TIMEOUT_S = 3.0  # connect, send the state, get "R": else the stream stays
GO_TIMEOUT_S = 30.0  # a new worker that said "R" waits this long for "G"
_HEAD = struct.Struct("!II")
_MAX_STATE = 64 * 2**20
_MAX_EARLY = 64 * 1024  # bytes of a client's next request buffered while its stream runs
_LATER = "later"


# -- the old worker's side ---------------------------------------------------------------------
class Outbound:
    """Hands the streams of a draining worker to the new workers' handover sockets, until
    it is stopped (the worker has drained)."""

    def __init__(self, gw: WorkerGateway, targets: list[str]) -> None:
        self.gw = gw
        self.targets = targets
        self._next = 0
        self._tried: weakref.WeakSet[StreamRelay] = weakref.WeakSet()
        self._task: asyncio.Task[None] | None = None
        self.handed = 0
        self.kept: dict[str, int] = {}

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self.handed or self.kept:
            log.info(
                "worker %d handed %d stream(s) to the new workers; kept %s",
                os.getpid(),
                self.handed,
                self.kept or "none",
            )

    def _relays(self) -> Iterator[StreamRelay]:
        for ep in list(self.gw.pool.endpoints.values()):
            yield from list(ep.relays)

    async def _run(self) -> None:
        while True:
            for relay in self._relays():
                if relay in self._tried:
                    continue
                try:
                    self._consider(relay)
                except Exception:  # this stream stays; the others still go
                    log.exception("handover of stream %s", relay.tracker.id)
                    self._tried.add(relay)
                    self._keep("error")
            await asyncio.sleep(SCAN_S)

    def _consider(self, relay: StreamRelay) -> None:
        why = why_not(relay)
        if why == _LATER:
            return
        self._tried.add(relay)
        if why is not None:
            self._keep(why)
            return
        target = self.targets[self._next % len(self.targets)]
        self._next += 1

        async def transfer(r: StreamRelay) -> bool:
            return await self._transfer(r, target)

        if not relay.hand_over(transfer):
            self._tried.discard(relay)  # between legs: next round

    def _keep(self, why: str) -> None:
        self.kept[why] = self.kept.get(why, 0) + 1

    async def _transfer(self, relay: StreamRelay, target: str) -> bool:
        """In the stream's task, its leg cut: move it to `target` (True), or leave it here
        (False: the relay continues it by continuation)."""
        try:
            return await self._move(relay, target)
        except Exception:  # whatever went wrong, the stream must go on here
            log.exception("handover of stream %s failed; it continues here", relay.tracker.id)
            self._keep("error")
            return False

    async def _move(self, relay: StreamRelay, target: str) -> bool:
        sink = relay.sink
        assert sink is not None
        t = sink.transport
        if t is None:
            return False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + FLUSH_TIMEOUT_S
        # Every byte relayed so far must be in the kernel: nothing follows from this process.
        while sink.buffered or t.get_write_buffer_size():
            if t.is_closing() or loop.time() > deadline:
                self._keep("client_gone" if t.is_closing() else "client_behind")
                return False
            await asyncio.sleep(0.005)
        if t.is_closing():
            self._keep("client_gone")
            return False
        proto = t.get_protocol()
        if _early_bytes(proto):
            self._keep("next_request_read")
            return False
        if isinstance(proto, _Conn):
            close = proto.close
        else:  # the response said `Connection: close` (a draining worker's answer)
            close = relay.resp is None or relay.resp.keep_alive is False
        lease = self.gw.proxy.tenancy.lease_state(relay)
        state = orjson.dumps(
            HandoverState(v=SNAPSHOT_VERSION, close=close, lease=lease, **relay.snapshot())
        )
        fd = t.get_extra_info("socket").fileno()
        reading = t.is_reading()
        if reading:
            t.pause_reading()  # what the client sends next is read by the new worker
        ok = False
        try:
            for tgt in [target] + [x for x in self.targets if x != target]:
                try:
                    ok = await _offer(tgt, fd, state, relay.body)
                except (OSError, TimeoutError) as e:
                    log.warning("handover of stream %s to %s: %s", relay.tracker.id, tgt, e)
                if ok or t.is_closing():
                    break
        finally:
            if not ok and reading and not t.is_closing():
                t.resume_reading()
        if not ok:
            self._keep("refused")
            return False
        # Committed ("G" is sent; no await since): the new worker writes from now on. Drop
        # this process's copy of the socket without a byte (and without a FIN: the other
        # copy keeps the connection open).
        if isinstance(proto, _Conn):
            proto.detached = True
        with contextlib.suppress(Exception):
            t.abort()
        self.handed += 1
        with contextlib.suppress(Exception):
            self.gw.send(HandedMsg(t="handed", dir="out"))
        log.debug("stream %s handed to %s after %d tokens", relay.tracker.id, target, relay.sent)
        return True


def why_not(relay: StreamRelay) -> str | None:
    """None when `relay` can be handed over now; _LATER when perhaps later; else why not."""
    sink = relay.sink
    if sink is None or relay.up is None or relay.interrupted is not None:
        return _LATER  # before its first event, or between legs
    t = relay.tracker
    if t.finished or t.done:
        return "finishing"
    if not getattr(sink, "_framed", False):
        return _LATER if getattr(sink, "_can_frame", False) else "not_chunked"
    if sink.buffered:
        return _LATER  # a client behind: perhaps it catches up
    tr = sink.transport
    if tr is None or tr.is_closing():
        return "client_gone"
    return not_migratable(relay.raw, relay.chat, tokens=relay.token_path())


def _early_bytes(proto: Any) -> bool:
    """Has the client's next request (or part of it) been read from the socket already?
    Those bytes would not travel with it."""
    if isinstance(proto, _Conn):
        return bool(proto.buf)
    return bool(getattr(proto, "_messages", None)) or bool(getattr(proto, "_message_tail", b""))


async def _offer(target: str, fd: int, state: bytes, body: bytes) -> bool:
    """Offer the stream to the worker at `target`; True once it took it ("R", then "G")."""
    loop = asyncio.get_running_loop()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.setblocking(False)
        async with asyncio.timeout(OFFER_TIMEOUT_S):
            await loop.sock_connect(s, target)
            head = _HEAD.pack(len(state), len(body))
            sent = socket.send_fds(s, [head], [fd])
            await loop.sock_sendall(s, head[sent:] + state + body)
            reply = await loop.sock_recv(s, 1)
        if reply != b"R":
            return False
        s.send(b"G")  # no await between "R" and here: nothing can cancel a half commit
        return True


# -- the new worker's side ---------------------------------------------------------------------
class _Conn(asyncio.Protocol):
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

    def __init__(self, gw: WorkerGateway, path: str) -> None:
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
                head, fds = await _recv_fds(loop, c, _HEAD.size)
                head += await _recv_exactly(loop, c, _HEAD.size - len(head))
                n_state, n_body = _HEAD.unpack(head)
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
        conn = _Conn(close)
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

    def _keep_serving(self, conn: _Conn) -> None:
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


# -- the listening socket, from orphaned workers to a new main process ------------------------
# When the main process dies (kill -9), its workers keep serving on the listening socket they
# inherited and offer it at a known path: one Unix socket per worker in `takeover_dir(port)`.
# A new main process (the supervisor's restart) takes it from there (`SCM_RIGHTS`) instead of
# binding, so the kernel's accept queue is the same before, during and after the restart and
# no connection is refused or reset. An orphan that has given it away drains and exits.


def takeover_dir(port: int) -> Path:
    """Where orphaned workers of the gateway on `port` offer their listening socket."""
    from unbroken.config.paths import state_dir

    return state_dir() / "gateway" / f"listen-{port}"


async def offer_listener(
    listen: socket.socket, port: int, given: Callable[[], None], taken: Callable[[], None]
) -> None:
    """Offer `listen` to the next main process until one takes it: `given` once it has the
    socket, `taken` once its workers serve (it closed the connection). Runs until then or
    cancelled; the offer's socket file is removed when it ends."""
    d = takeover_dir(port)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = d / f"{os.getpid()}.sock"
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.setblocking(False)
    try:
        srv.bind(str(path))
        os.chmod(path, 0o600)
        srv.listen(4)
        loop = asyncio.get_running_loop()
        conn, _ = await loop.sock_accept(srv)
        with conn:
            conn.setblocking(True)
            conn.settimeout(2.0)
            socket.send_fds(conn, [b"L"], [listen.fileno()])
            log.warning("worker %d: a new main process took the listening socket", os.getpid())
            given()
            conn.setblocking(False)
            # Serve on until its workers serve too (it closes this connection then), so
            # that nothing waits in the accept queue meanwhile.
            with contextlib.suppress(OSError):
                await loop.sock_recv(conn, 1)
        taken()
    finally:
        srv.close()
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def take_listener(port: int) -> tuple[socket.socket | None, list[socket.socket]]:
    """The listening socket on `port` from orphaned workers of a dead main process, or None
    (none offered it: bind a new one), and one connection per offering worker: each serves
    on until its connection is closed, then drains."""
    d = takeover_dir(port)
    got: socket.socket | None = None
    held: list[socket.socket] = []
    for path in sorted(d.glob("*.sock")) if d.is_dir() else []:
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.settimeout(2.0)
        try:
            c.connect(str(path))
            _, fds, _, _ = socket.recv_fds(c, 1, 1)
        except OSError:  # its worker is gone: a stale file
            c.close()
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            continue
        held.append(c)
        for fd in fds:
            if got is None:
                got = socket.socket(fileno=fd)
            else:
                os.close(fd)  # the same socket again, from another worker
    return got, held
