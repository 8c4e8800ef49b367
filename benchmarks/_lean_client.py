"""A load client light enough not to be what it measures.

`unbroken bench`'s load generator (aiohttp, one StreamReader wake-up, SSE decode and
`orjson.loads` per event, usage on every chunk) costs ~20-30 us of CPU per token; at 1,024
streams of 50 tokens/s that is more than a core of a 2-core machine, taken from the engine and
the gateway it is meant to measure. This client does the least a latency measurement needs.
HTTP is the gateway's own upstream client (`unbroken.gateway._upstream.Upstream`: keep-alive
HTTP/1.1, llhttp via `httptools`, the body handed over inside the read callback); token
events are counted in each read (`data: {`) and the time of every read is kept. A request is
ok when it answered 200, ended with `data: [DONE]` and had no error event.

Closed loop: `users` clients, each starting at its own offset over `ramp` and sending
completions back to back until `duration` seconds from the start.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import orjson

from unbroken.gateway._upstream import Upstream

__all__ = ["LeanRecord", "LeanRun"]

_EVENT = b"data: {"
_DONE = b"data: [DONE]"
_ERROR = b'{"error"'
_HEADERS = {"Content-Type": "application/json"}


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


class _Events:
    """Counts one response's token events as its body arrives (a marker may be split across
    two reads: the end of the last one is kept)."""

    __slots__ = ("done", "error", "last", "rec", "t0", "tail")

    def __init__(self, rec: LeanRecord, t0: float) -> None:
        self.rec, self.t0, self.last = rec, t0, t0
        self.tail = b""
        self.done = self.error = False

    def on_body(self, body: bytes) -> None:
        now = time.monotonic()
        rec = self.rec
        seen = self.tail + body
        n = seen.count(_EVENT) - self.tail.count(_EVENT)
        if _ERROR in seen:
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


class LeanRun:
    """`users` closed-loop streaming clients of /v1/completions (module doc). `records`
    holds every request; `now()` is seconds since the run started."""

    def __init__(
        self, url: str, users: int, duration: float, max_tokens: int, ramp: float, model: str
    ) -> None:
        self.url = url.rstrip("/")
        self.users, self.duration, self.ramp = users, duration, ramp
        self.max_tokens = max_tokens
        self.model = model
        self.records: list[LeanRecord] = []
        self._t0 = 0.0

    def now(self) -> float:
        return time.monotonic() - self._t0

    def _body(self, user: int, i: int) -> bytes:
        return orjson.dumps(
            {
                "model": self.model,
                "prompt": f"user {user} request {i}",
                "max_tokens": self.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
        )

    async def _one(self, upstream: Upstream, rec: LeanRecord, body: bytes) -> None:
        t0 = time.monotonic()
        try:
            up = await upstream.request(self.url, "/v1/completions", body, _HEADERS)
            if up.status != 200:
                await up.read()
                rec.outcome, rec.detail = "error", f"HTTP {up.status}"
                return
        except OSError as e:  # ConnectionError (and the client's UpstreamClosed) included
            rec.outcome, rec.detail = "error", f"{type(e).__name__}: {e}"
            await asyncio.sleep(0.1)
            return
        ev = _Events(rec, t0)
        ended: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()

        def on_end(exc: BaseException | None) -> None:
            if not ended.done():
                ended.set_result(exc)

        up.stream(ev.on_body, on_end)
        exc = await ended
        if exc is not None:
            up.close()
            rec.outcome, rec.detail = "error", f"connection lost: {exc}"
            return
        up.release()
        if ev.error:
            rec.outcome, rec.detail = "error", "error event"
        elif not ev.done:
            rec.outcome, rec.detail = "truncated", "no [DONE]"
        else:
            rec.outcome = "ok"

    async def _user(self, upstream: Upstream, user: int) -> None:
        await asyncio.sleep(user * self.ramp / self.users)
        i = 0
        while self.now() < self.duration:
            rec = LeanRecord(start=self.now())
            self.records.append(rec)
            await self._one(upstream, rec, self._body(user, i))
            i += 1

    async def run(self) -> None:
        self._t0 = time.monotonic()
        upstream = Upstream()
        try:
            await asyncio.gather(*(self._user(upstream, u) for u in range(self.users)))
        finally:
            upstream.close()
