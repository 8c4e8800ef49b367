"""The state one client stream keeps across its legs (`RelayState`), declared in one place
for the layers of `_stream.StreamRelay` above it: `_stream_breaks` (a break: continue or
end), `_stream_handover` (a stream moved to another process) and `_stream` (one leg and its
read callback, the per-chunk path). Also the stream's writes outside that callback
(`_send`): the first, which prepares the response's headers, and what a break sends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Self

import orjson
from aiohttp import web

from unbroken.gateway import _later as later
from unbroken.gateway._pool import Endpoint
from unbroken.gateway._prefix import RouteHint
from unbroken.gateway._relay import ClientSink, SSEResponse, StreamTracker
from unbroken.gateway._stream_host import RelayHost
from unbroken.gateway._transform import Transform
from unbroken.gateway._upstream import UpstreamResponse
from unbroken.wire.http import SSE_HEADERS
from unbroken.wire.sse import SSEDecoder

__all__ = ["RelayState"]


class RelayState:
    """One client stream's state (module doc); `_stream.StreamRelay` is the whole relay."""

    __slots__ = (
        "__weakref__",  # `_handover` holds relays weakly
        "_dec",
        "_exc",
        "_first",
        "_gap_max",
        "_gaps",
        "_handoff",
        "_held",
        "_itl",
        "_last_event",
        "_last_token",
        "_later",
        "_loop",
        "_outq",
        "_raw",
        "_rearm_at",
        "_started",
        "_tail",
        "_tmo",
        "_verdict",
        "_wake",
        "body",
        "chat",
        "ep",
        "failed",
        "headers",
        "hint",
        "interrupted",
        "late_moves",
        "migrations",
        "model",
        "p",
        "path",
        "priority",
        "request",
        "resp",
        "sink",
        "t0",
        "up",
        "weight",
        "x",
    )

    def __init__(
        self,
        proxy: RelayHost,
        request: web.Request,
        *,
        path: str,
        body: bytes,
        chat: bool,
        model: str,
        priority: str,
        headers: dict[str, str],
        t0: float,
        weight: int = 1,
        augmented: bool = False,
        wants: tuple[bool, bool, bool] = (False, False, False),
        hint: RouteHint | None = None,
    ) -> None:
        self.p = proxy
        self.hint = hint  # the prompt's block names: a continuation prefers who holds them
        self.request = request
        self.path = path
        self.body = body
        self._raw: dict[str, Any] | None = None
        self.weight = weight
        self.chat = chat
        self.model = model
        self.priority = priority
        self.headers = headers
        self.t0 = t0
        self.x = Transform(chat, augmented=augmented, wants=wants)
        self.resp: web.StreamResponse | None = None
        self.sink: ClientSink | None = None
        self.ep: Endpoint | None = None
        self.up: UpstreamResponse | None = None
        self.interrupted: str | None = None
        self.late_moves = 0  # times this request was re-sent for a late step (`_forward`)
        self.failed: list[Endpoint] = []
        self.migrations = 0
        self._tmo: asyncio.Timeout | None = None
        self._last_event = 0.0
        self._rearm_at = 0.0
        self._gaps = 0
        self._gap_max = 0.0
        self._last_token = 0.0
        self._itl: Any = None
        # One leg's read-callback state (see `_pump`).
        self._loop = asyncio.get_running_loop()
        self._wake: asyncio.Future[None] = self._loop.create_future()
        self._later = later.for_loop(self._loop)  # later tokens wait for new work (`_later`)
        self._held = 0  # chunks of this stream held there
        self._dec = SSEDecoder()
        self._first = True
        self._started = 0.0
        self._verdict: str | None = None
        self._exc: BaseException | None = None
        self._outq: list[bytes] = []
        # The stream's last bytes ([DONE]), held for the response's end: one write (`_take`).
        self._tail = b""
        # Set by `hand_over`: moves the stream to another process once its leg is cut.
        self._handoff: Callable[[Self], Awaitable[bool]] | None = None

    @property
    def raw(self) -> dict[str, Any]:
        """The request as a dict, parsed only when a migration needs it (a stream keeps its
        body's bytes, not a second, larger copy of it)."""
        if self._raw is None:
            self._raw = orjson.loads(self.body)
        return self._raw

    @property
    def tracker(self) -> StreamTracker:
        """What went through this stream so far (its transform's)."""
        return self.x.tracker

    @property
    def sent(self) -> int:
        """Tokens the client has, as the engine counts them."""
        return self.x.sent

    def token_path(self) -> bool:
        """Can this stream continue from token ids?"""
        return self.x.token_path()

    @property
    def last_event(self) -> float:
        """When this stream's current leg last got an event (loop time; 0 before any)."""
        return self._last_event

    async def _send(self, data: bytes) -> None:
        """To the client from the stream's task, in order; the first write prepares the
        response (its headers, which name the endpoint)."""
        if self.sink is None:
            assert self.ep is not None
            self.resp = SSEResponse(
                headers={**SSE_HEADERS, **self.p.response_headers(self.headers, self.ep)}
            )
            await self.resp.prepare(self.request)
            self.sink = self.p.stream_sink(self.request, self.resp)
        await self.sink.send(data)

    def _response(self) -> web.StreamResponse:
        assert self.resp is not None
        return self.resp
