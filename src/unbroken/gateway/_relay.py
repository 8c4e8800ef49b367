"""Relaying one SSE stream: what the client has been sent, and a bounded per-stream buffer
that keeps a slow client from ever slowing the upstream read.

`StreamTracker` follows every event (id, text per choice, finish): it decides whether a
stream ended with its finish, and it is what mid-stream continuation builds on.
`ClientSink` writes straight to the client while its socket keeps up; once the socket backs
up, events queue in memory (up to a bound) and a writer task feeds the client at its pace
while the upstream keeps being read at engine speed. All sinks share one `BufferBudget`:
when the bytes queued for slow clients exceed it, the stream with the most queued is ended
first, with an SSE error event saying why.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

__all__ = [
    "AdoptedSink",
    "BufferBudget",
    "ClientGone",
    "ClientSink",
    "SSEResponse",
    "SlowClient",
    "StreamTracker",
]

# Direct writes only while the socket's own buffer is below this: aiohttp's write() then
# never waits on the transport, so the upstream read loop never blocks on the client.
_DIRECT_LIMIT = 32 * 1024
_WRITE_CHUNK = 64 * 1024


class ClientGone(Exception):
    """The client closed its connection."""


class SlowClient(Exception):
    """The client fell behind by more than the per-stream buffer."""


class BufferBudget:
    """The bytes all streams together may queue for clients that read slowly."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.sinks: set[ClientSink] = set()
        self.evicted = 0

    def grow(self, sink: ClientSink, n: int) -> None:
        self.used += n
        while self.used > self.limit and self.sinks:
            victim = max(self.sinks, key=lambda k: k.buffered)
            if victim.buffered == 0:
                break
            self.evicted += 1
            victim.evict(
                "the gateway's stream buffer budget is exhausted and this client reads the "
                "slowest; its stream was ended"
            )

    def shrink(self, n: int) -> None:
        self.used -= n


def _error_event(message: str, code: str = "slow_client") -> bytes:
    err = {"message": message, "type": "server_error", "param": None, "code": code}
    return b"data: " + orjson.dumps({"error": err}) + b"\n\ndata: [DONE]\n\n"


class ClientSink:
    __slots__ = (
        "_can_frame",
        "_error",
        "_evicted",
        "_framed",
        "_pending",
        "_pending_bytes",
        "_writer",
        "budget",
        "limit",
        "resp",
        "transport",
    )

    def __init__(
        self,
        resp: web.StreamResponse,
        transport: asyncio.Transport | None,
        limit: int,
        budget: BufferBudget | None = None,
    ) -> None:
        self.resp = resp
        self.transport = transport
        self.limit = limit
        self.budget = budget
        self._pending: deque[bytes] = deque()
        self._pending_bytes = 0
        self._writer: asyncio.Task[None] | None = None
        self._error: BaseException | None = None
        self._evicted: str | None = None
        if budget is not None:
            budget.sinks.add(self)
        # Chunked and uncompressed: once aiohttp has sent the (buffered) headers with the
        # first write, later chunks may be framed here.
        self._framed = False
        self._can_frame = (
            resp.headers.get("Transfer-Encoding") == "chunked"
            and "Content-Encoding" not in resp.headers
        )

    @property
    def buffered(self) -> int:
        return self._pending_bytes

    def send_nowait(self, data: bytes) -> bool:
        """Send or queue `data` without waiting; False when only `send` can (the first write,
        which carries the response's headers, or a client aiohttp must frame itself)."""
        if self._evicted is not None:
            raise SlowClient(self._evicted)
        if self._error is not None:
            raise ClientGone() from self._error
        t = self.transport
        if t is None or t.is_closing():
            raise ClientGone()
        if not self._pending and t.get_write_buffer_size() + len(data) < _DIRECT_LIMIT:
            if not self._framed:
                return False
            # Hot path: one chunk of HTTP/1.1 chunked encoding, framed here and handed to the
            # transport in one call (aiohttp's writer would take four Python calls and a
            # coroutine for the same bytes). The socket is below its high-water mark, so
            # nothing waits.
            t.write(b"%x\r\n%b\r\n" % (len(data), data))
            return True
        self._pending.append(data)
        self._pending_bytes += len(data)
        if self._pending_bytes > self.limit:
            why = f"the client fell more than {self.limit} bytes behind; its stream was ended"
            self.evict(why)
            raise SlowClient(why)
        if self.budget is not None:
            self.budget.grow(self, len(data))
            if self._evicted is not None:
                raise SlowClient(self._evicted)
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._drain())
        return True

    async def send(self, data: bytes) -> None:
        if self.send_nowait(data):
            return
        try:
            await self.resp.write(data)
        except (ConnectionError, RuntimeError) as e:
            self._error = e
            raise ClientGone() from e
        self._framed = self._can_frame

    async def _drain(self) -> None:
        try:
            while self._pending:
                # At most _WRITE_CHUNK per write: what sits in the socket's own buffer is
                # outside the budget, and an evicted client must reach its error event soon.
                parts: list[bytes] = []
                n = 0
                while self._pending and n < _WRITE_CHUNK:
                    parts.append(self._pending.popleft())
                    n += len(parts[-1])
                self._pending_bytes -= n
                if self.budget is not None:
                    self.budget.shrink(n)
                await self._write_queued(b"".join(parts))
        except (ConnectionError, RuntimeError) as e:
            self._error = e

    async def _write_queued(self, data: bytes) -> None:
        """Write queued bytes at the client's pace."""
        await self.resp.write(data)

    def evict(self, why: str, code: str = "slow_client") -> None:
        """End this stream for being too slow (or for a shutdown that cannot wait, `code`
        "shutdown"): drop what is queued, send an error event behind what the socket
        already holds, and close once that is flushed."""
        if self._evicted is not None:
            return
        self._evicted = why
        if self.budget is not None:
            self.budget.shrink(self._pending_bytes)
            self.budget.sinks.discard(self)
        self._pending.clear()
        self._pending_bytes = 0
        if self._writer is not None and not self._writer.done():
            self._writer.cancel()  # a chunk is written whole before its drain is awaited
        t = self.transport
        if t is None or t.is_closing():
            return
        ev = _error_event(why, code)
        with contextlib.suppress(Exception):
            t.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(ev), ev) if self._can_frame else ev)
            t.close()  # close() flushes what is buffered first; abort() would not

    def detach(self) -> None:
        """The stream is over: stop counting against the budget."""
        if self.budget is not None:
            self.budget.shrink(self._pending_bytes)
            self.budget.sinks.discard(self)
            self._pending_bytes = 0

    async def finish(self, tail: bytes = b"") -> None:
        """Send what is queued (at the client's pace) and end the response; `tail`, the
        last bytes, with the response's end in one write when nothing is queued."""
        if (
            tail
            and self._framed
            and not self._pending
            and (self._writer is None or self._writer.done())
            and self._evicted is None
            and self._error is None
        ):
            await self._end(tail)
            return
        if tail:
            await self.send(tail)
        if self._writer is not None:
            try:
                await self._writer
            except asyncio.CancelledError:
                if self._evicted is None or not self._writer.cancelled():
                    raise
        if self._evicted is not None:
            raise SlowClient(self._evicted)
        if self._error is not None:
            raise ClientGone() from self._error
        await self._end()

    async def _end(self, tail: bytes = b"") -> None:
        """Everything before `tail` is sent: `tail` and the response's end."""
        try:
            await self.resp.write_eof(tail)
        except (ConnectionError, RuntimeError) as e:
            raise ClientGone() from e

    def abort(self) -> None:
        self.detach()
        if self._writer is not None and not self._writer.done():
            self._writer.cancel()
        if self.transport is not None:
            with contextlib.suppress(Exception):
                self.transport.close()


class SSEResponse(web.StreamResponse):
    """A relayed stream's response: its headers go out with its first event, in one write
    (aiohttp's StreamResponse sends them alone at `prepare`, as its web.Response does not:
    one more syscall per request, and one more wake-up of the client, for bytes the client
    cannot use before the event; the relay prepares only once the first event is in)."""

    _send_headers_immediately = False


class AdoptedSink(ClientSink):
    """The sink of a stream whose client connection this process adopted mid-response from
    another worker (`_handover`, at a reload). Its headers went out long ago and no aiohttp
    response owns the connection: every chunk is framed here (HTTP/1.1 chunked), a client
    that backs up is fed at its pace by waiting on the transport itself (`drained`), and
    `finish` writes the last chunk and hands the connection on (`on_finish`: serve its next
    request, or close it)."""

    __slots__ = ("_drained", "ended", "on_finish")

    def __init__(
        self,
        transport: asyncio.Transport,
        limit: int,
        budget: BufferBudget | None,
        drained: Callable[[], Awaitable[None]],
        on_finish: Callable[[], None],
    ) -> None:
        # A stand-in response, never prepared: it only says the body is chunked.
        super().__init__(
            web.StreamResponse(headers={"Transfer-Encoding": "chunked"}), transport, limit, budget
        )
        self._framed = True
        self._drained = drained
        self.on_finish = on_finish
        self.ended = False  # finished, ended or aborted by the gateway (not the client)

    async def _write_queued(self, data: bytes) -> None:
        t = self.transport
        if t is None or t.is_closing():
            raise ConnectionResetError("the client closed its connection")
        t.write(b"%x\r\n%b\r\n" % (len(data), data))
        await self._drained()

    def evict(self, why: str, code: str = "slow_client") -> None:
        self.ended = True
        super().evict(why, code)

    async def _end(self, tail: bytes = b"") -> None:
        t = self.transport
        if t is None or t.is_closing():
            raise ClientGone()
        self.ended = True
        t.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(tail), tail) if tail else b"0\r\n\r\n")
        self.on_finish()

    def abort(self) -> None:
        self.ended = True
        super().abort()


class StreamTracker:
    """What has gone through a completions or chat stream so far."""

    __slots__ = (
        "chat",
        "created",
        "done",
        "error",
        "finish",
        "id",
        "model",
        "role_sent",
        "texts",
        "token_events",
    )

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.id: str | None = None
        self.created: int | None = None
        self.model: str | None = None
        self.texts: dict[int, list[str]] = {}
        self.finish: dict[int, str] = {}
        self.role_sent: set[int] = set()
        self.token_events = 0
        self.done = False
        self.error: dict[str, Any] | None = None

    def observe_obj(self, obj: dict[str, Any]) -> int:
        """Take in one decoded event; return 1 if it carried a token, else 0."""
        if "error" in obj:
            err = obj["error"]
            self.error = err if isinstance(err, dict) else {"message": str(err)}
            return 0
        if self.id is None:
            self.id = obj.get("id")
            self.created = obj.get("created")
            self.model = obj.get("model")
        tokens = 0
        for ch in obj.get("choices") or ():
            idx = ch.get("index", 0)
            if self.chat:
                delta = ch.get("delta") or {}
                if "role" in delta:
                    self.role_sent.add(idx)
                text = delta.get("content")
            else:
                text = ch.get("text")
            if text:
                self.texts.setdefault(idx, []).append(text)
                tokens += 1
            if ch.get("finish_reason"):
                self.finish[idx] = ch["finish_reason"]
        self.token_events += tokens
        return tokens

    @property
    def finished(self) -> bool:
        return self.error is None and bool(self.finish)

    def text(self, index: int = 0) -> str:
        return "".join(self.texts.get(index, ()))
