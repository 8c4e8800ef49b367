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

The new worker's side (adopting the connection and carrying the stream on) is
`_handover_in.py`; the listening socket's takeover after the main process died is
`_takeover.py`. Both are re-exported here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import weakref
from collections.abc import Iterator
from typing import Any

import orjson

from unbroken.gateway._continuation import not_migratable
from unbroken.gateway._handover_in import (
    HEAD,
    OFFER_TIMEOUT_S,
    AdoptedConn,
    HandoverHost,
    Inbound,
)
from unbroken.gateway._messages import SNAPSHOT_VERSION, HandedMsg, HandoverState
from unbroken.gateway._stream import StreamRelay
from unbroken.gateway._takeover import offer_listener, take_listener, takeover_dir

__all__ = [
    "HandoverHost",
    "Inbound",
    "Outbound",
    "offer_listener",
    "take_listener",
    "takeover_dir",
    "why_not",
]

log = logging.getLogger("unbroken.gateway.handover")

SCAN_S = 0.05  # how often an old worker looks for streams it can hand over
FLUSH_TIMEOUT_S = 2.0  # a client must take what it was sent within this, else the stream stays
_LATER = "later"


# -- the old worker's side ---------------------------------------------------------------------
class Outbound:
    """Hands the streams of a draining worker to the new workers' handover sockets, until
    it is stopped (the worker has drained)."""

    def __init__(self, gw: HandoverHost, targets: list[str]) -> None:
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
        if isinstance(proto, AdoptedConn):
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
        if isinstance(proto, AdoptedConn):
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
    if isinstance(proto, AdoptedConn):
        return bool(proto.buf)
    return bool(getattr(proto, "_messages", None)) or bool(getattr(proto, "_message_tail", b""))


async def _offer(target: str, fd: int, state: bytes, body: bytes) -> bool:
    """Offer the stream to the worker at `target`; True once it took it ("R", then "G")."""
    loop = asyncio.get_running_loop()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.setblocking(False)
        async with asyncio.timeout(OFFER_TIMEOUT_S):
            await loop.sock_connect(s, target)
            head = HEAD.pack(len(state), len(body))
            sent = socket.send_fds(s, [head], [fd])
            await loop.sock_sendall(s, head[sent:] + state + body)
            reply = await loop.sock_recv(s, 1)
        if reply != b"R":
            return False
        s.send(b"G")  # no await between "R" and here: nothing can cancel a half commit
        return True
