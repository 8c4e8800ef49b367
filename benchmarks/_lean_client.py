"""A load client light enough not to be what it measures.

`unbroken bench`'s load generator (aiohttp, one StreamReader wake-up, SSE decode and
`orjson.loads` per event, usage on every chunk) costs ~20-30 us of CPU per token; at 1,024
streams of 50 tokens/s that is more than a core of a 2-core machine, taken from the engine and
the gateway it is meant to measure. This client does the least a latency measurement needs:
one keep-alive HTTP/1.1 connection per user (llhttp via `httptools`), the response parsed in
the protocol's callbacks, token events counted in each read (`data: {`), the time of every
read kept. A request is ok when it answered 200, ended with `data: [DONE]` and carried the
tokens it asked for with no error event.

Closed loop: `users` clients, each starting at its own offset over `ramp` and sending
completions back to back until `duration` seconds from the start.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httptools
import orjson

__all__ = ["LeanRecord", "LeanRun"]

_EVENT = b"data: {"
_DONE = b"data: [DONE]"
_ERROR = b'{"error"'


@dataclass(slots=True)
class LeanRecord:
    """What `benchmarks/gateway_overhead.py` reads of a request (the fields of
    `unbroken.bench.load.Record` it uses)."""

    start: float
    outcome: str = "pending"
    detail: str | None = None
    ttft: float | None = None
    tokens: int = 0
    gaps: list[float] = field(default_factory=list)


class _Conn(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.rec: LeanRecord | None = None
        self.t0 = 0.0
        self.last = 0.0
        self.status = 0
        self.done = False
        self.error = False
        self.tail = b""  # the end of the last read: a marker split across two reads
        self.keep = True
        self.finished: asyncio.Future[None] | None = None
        self.lost = False

    # -- asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._end(f"bad response: {e}")
            if self.transport is not None:
                self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._end(f"connection lost: {exc or 'closed'}")

    # -- httptools callbacks -----------------------------------------------------------------
    def on_status(self, status: bytes) -> None:
        self.status = self.parser.get_status_code()

    def on_headers_complete(self) -> None:
        self.keep = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        rec = self.rec
        if rec is None or self.status != 200:
            return
        now = time.monotonic()
        seen = self.tail + body
        n = seen.count(_EVENT) - self.tail.count(_EVENT)
        if _ERROR in body:
            self.error = True
        if _DONE in seen:
            self.done = True
        self.tail = seen[-16:]
        if n <= 0:
            return
        if rec.ttft is None:
            rec.ttft = now - self.t0
        else:
            rec.gaps.append(now - self.last)
        if n > 1:
            rec.gaps.extend([0.0] * (n - 1))  # several events in one read
        rec.tokens += n
        self.last = now

    def on_message_complete(self) -> None:
        rec = self.rec
        if rec is None:
            return
        if self.status != 200:
            rec.outcome, rec.detail = "error", f"HTTP {self.status}"
        elif self.error:
            rec.outcome, rec.detail = "error", "error event"
        elif not self.done:
            rec.outcome, rec.detail = "truncated", "no [DONE]"
        else:
            rec.outcome = "ok"
        self._end(None)

    def _end(self, why: str | None) -> None:
        rec, self.rec = self.rec, None
        if rec is not None and why is not None:
            rec.outcome, rec.detail = "error", why
        if self.finished is not None and not self.finished.done():
            self.finished.set_result(None)

    # -- used by the user loop ---------------------------------------------------------------
    def send(self, request: bytes, rec: LeanRecord) -> asyncio.Future[None]:
        assert self.transport is not None
        self.rec, self.status, self.done, self.error, self.tail = rec, 0, False, False, b""
        self.finished = asyncio.get_running_loop().create_future()
        self.t0 = time.monotonic()
        self.transport.write(request)
        return self.finished


class LeanRun:
    """`users` closed-loop streaming clients of /v1/completions (module doc). `records`
    holds every request; `now()` is seconds since the run started."""

    def __init__(
        self, url: str, users: int, duration: float, max_tokens: int, ramp: float, model: str
    ) -> None:
        u = urlsplit(url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.users, self.duration, self.ramp = users, duration, ramp
        self.max_tokens = max_tokens
        self.model = model
        self.records: list[LeanRecord] = []
        self._t0 = 0.0

    def now(self) -> float:
        return time.monotonic() - self._t0

    def _request(self, user: int, i: int) -> bytes:
        body = orjson.dumps(
            {
                "model": self.model,
                "prompt": f"user {user} request {i}",
                "max_tokens": self.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
        )
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        return head.encode() + body

    async def _user(self, user: int) -> None:
        await asyncio.sleep(user * self.ramp / self.users)
        loop = asyncio.get_running_loop()
        conn: _Conn | None = None
        i = 0
        while self.now() < self.duration:
            rec = LeanRecord(start=self.now())
            self.records.append(rec)
            if conn is None or conn.lost or not conn.keep:
                if conn is not None and conn.transport is not None:
                    conn.transport.close()
                try:
                    _, conn = await loop.create_connection(_Conn, self.host, self.port)
                except OSError as e:
                    rec.outcome, rec.detail = "error", f"connect: {e}"
                    conn = None
                    await asyncio.sleep(0.1)
                    continue
            await conn.send(self._request(user, i), rec)
            i += 1
        if conn is not None and conn.transport is not None:
            conn.transport.close()

    async def run(self) -> None:
        self._t0 = time.monotonic()
        await asyncio.gather(*(self._user(u) for u in range(self.users)))
