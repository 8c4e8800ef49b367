"""HTTP/1.1 to the engines: keep-alive connections per endpoint, and a response whose body
is handed to its consumer inside the read callback.

Why not aiohttp's client here: a relayed token crossed five Python layers and a task wake-up
between the socket and the relay (protocol, parser glue, StreamReader, a future, the
iterator). Here the C parser (llhttp, via httptools) calls `on_body` from `data_received`,
and a streaming consumer takes the bytes right there: the relay decodes the events and writes
them to the client in the same callback, with no task switch per chunk. aiohttp's client
still serves the gateway's other upstream calls (probes, /v1/models, pass-through routes).

Connections are reused (keep-alive) and kept idle for at most `IDLE_S`, below the 5 s of
uvicorn (vLLM's server) so that the engine never closes one under a request; a request sent
on a reused connection that closes before the first byte of an answer is sent once more on a
new connection (the engine cannot have acted on it).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp
import httptools

from unbroken.gateway._pool import Endpoint

__all__ = [
    "IDLE_S",
    "UPSTREAM_ERRORS",
    "Form",
    "Leg",
    "Retry",
    "Upstream",
    "UpstreamClosed",
    "UpstreamResponse",
]

IDLE_S = 4.0
_MAX_IDLE_PER_HOST = 512
_MAX_BODY = 64 * 1024 * 1024  # a non-streamed answer larger than this is a broken engine


class UpstreamClosed(ConnectionError):
    """The engine closed the connection, or sent what is not HTTP."""


# What a failed upstream call raises (aiohttp's client serves the gateway's other calls).
UPSTREAM_ERRORS = (aiohttp.ClientError, ConnectionError, OSError)


class Retry(Exception):
    """An attempt failed before the client received a byte: try another endpoint,
    invisibly. `kind` is the failure's name in metrics and on the endpoint's record."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


@dataclass(frozen=True, slots=True)
class Form:
    """One way of asking for a request, `kind` named for logs and metrics. An engine that
    refuses a sticky form (4xx) but takes a later one is not asked for it again."""

    kind: str
    path: str
    body: bytes
    sticky: bool = False


@dataclass(slots=True)
class Leg:
    """An upstream answer and the slots taken for it."""

    up: UpstreamResponse
    ep: Endpoint
    n: int
    kind: str
    data: bytes | None  # the body, when it was read (an error, or not a stream)


@dataclass(frozen=True, slots=True)
class _Origin:
    host: str
    port: int
    tls: bool
    base: str  # the endpoint URL's own path prefix, without the trailing slash
    host_header: str


def _origin(url: str) -> _Origin:
    u = urlsplit(url)
    tls = u.scheme == "https"
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    port = u.port or (443 if tls else 80)
    host = u.hostname
    shown = f"[{host}]" if ":" in host else host
    default = (tls and port == 443) or (not tls and port == 80)
    return _Origin(host, port, tls, u.path.rstrip("/"), shown if default else f"{shown}:{port}")


class UpstreamResponse:
    """One response. Headers are known when `Upstream.request` returns; the body is either
    read whole (`read`) or streamed to callbacks (`stream`), never both."""

    __slots__ = (
        "_body",
        "_conn",
        "_done",
        "_on_body",
        "_on_end",
        "_release_timer",
        "complete",
        "content_type",
        "error",
        "headers",
        "status",
    )

    def __init__(self, conn: _Conn) -> None:
        self._conn: _Conn | None = conn
        self.status = 0
        self.headers: dict[str, str] = {}
        self.content_type = ""
        self.complete = False
        self.error: BaseException | None = None
        self._body: list[bytes] = []
        self._on_body: Callable[[bytes], None] | None = None
        self._on_end: Callable[[BaseException | None], None] | None = None
        self._done: asyncio.Future[None] | None = None
        self._release_timer: asyncio.TimerHandle | None = None

    # -- fed by the connection ------------------------------------------------------------
    def _keep(self, data: bytes) -> None:
        """Body bytes before (or without) `stream`: kept for `read` or a later `stream`."""
        self._body.append(data)
        if len(self._body) > 4096 and sum(map(len, self._body)) > _MAX_BODY:
            self._end(UpstreamClosed("upstream answer larger than 64 MiB"))
            self.close()

    def _end(self, exc: BaseException | None) -> None:
        if self.complete or self.error is not None:
            return
        if exc is None:
            self.complete = True
        else:
            self.error = exc
        if self._done is not None and not self._done.done():
            self._done.set_result(None)
        cb = self._on_end
        if cb is not None:
            self._on_end = self._on_body = None
            cb(exc)

    # -- the consumer ---------------------------------------------------------------------
    async def read(self) -> bytes:
        """The whole body (raises UpstreamClosed if the connection breaks first)."""
        if not self.complete and self.error is None:
            self._done = asyncio.get_running_loop().create_future()
            await self._done
        if self.error is not None:
            raise UpstreamClosed(str(self.error)) from self.error
        data = b"".join(self._body)
        self._body = []
        self.release()
        return data

    def stream(
        self, on_body: Callable[[bytes], None], on_end: Callable[[BaseException | None], None]
    ) -> None:
        """Deliver the body to `on_body` as it arrives (what came already, first), then
        `on_end(None)` at its proper end or `on_end(exc)` when the connection breaks. Called
        from the event loop's read callback: the consumer must not block."""
        self._on_body, self._on_end = on_body, on_end
        body, self._body = self._body, []
        for b in body:
            if self._on_body is None:
                return
            on_body(b)
        if self.complete or self.error is not None:
            self._on_body = self._on_end = None
            on_end(self.error)

    def detach(self) -> None:
        """Stop delivering; later bytes are read and dropped."""
        self._on_body = self._on_end = None

    def release(self) -> None:
        """Done with this response: the connection goes back to the pool once the response
        has ended (soon, or it is closed after a second)."""
        self.detach()
        conn = self._conn
        if conn is None:
            return
        if self.complete:
            self._conn = None
            conn.reusable()
        elif self.error is not None:
            self.close()
        elif self._release_timer is None:
            # The engine's last bytes (the chunked terminator) usually follow [DONE] within
            # microseconds; wait for them rather than drop a good connection.
            self._on_end = self._late_end
            self._release_timer = asyncio.get_running_loop().call_later(1.0, self.close)

    def _late_end(self, exc: BaseException | None) -> None:
        if self._release_timer is not None:
            self._release_timer.cancel()
            self._release_timer = None
        if exc is None:
            self.release()
        else:
            self.close()

    def close(self) -> None:
        """Drop the connection (the engine sees the disconnect and frees the request)."""
        self._on_body = self._on_end = None
        if self._release_timer is not None:
            self._release_timer.cancel()
            self._release_timer = None
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


class _Conn(asyncio.Protocol):
    __slots__ = (
        "_headers_done",
        "_interim",
        "_parser",
        "_resp",
        "_upstream",
        "closed",
        "got_bytes",
        "key",
        "transport",
        "used",
    )

    def __init__(self, upstream: Upstream, key: _Origin) -> None:
        self._upstream = upstream
        self.key = key
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._resp: UpstreamResponse | None = None
        self._headers_done: asyncio.Future[None] | None = None
        self._interim = False
        self.closed = False
        self.got_bytes = False
        self.used = 0.0

    # -- asyncio ---------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(UpstreamClosed(f"malformed HTTP from the engine: {e}"))
            self.close()

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._upstream._forget(self)
        r = self._resp
        if (
            r is not None
            and exc is None
            and r.status
            and "content-length" not in r.headers
            and "chunked" not in r.headers.get("transfer-encoding", "")
        ):
            r._end(None)  # a body delimited by the connection's end
        else:
            self._fail(exc or UpstreamClosed("the engine closed the connection"))

    # -- httptools ------------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        r = self._resp
        if r is not None:
            r.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        r = self._resp
        if r is None:
            return
        status = self._parser.get_status_code()
        if status < 200:  # an interim answer (100 Continue): the real one follows
            self._interim = True
            r.headers.clear()
            return
        r.status = status
        r.content_type = r.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        f = self._headers_done
        if f is not None and not f.done():
            f.set_result(None)

    def on_body(self, body: bytes) -> None:
        r = self._resp
        if r is not None:
            cb = r._on_body
            if cb is not None:
                cb(body)  # streamed: straight to the consumer, inside this read callback
            else:
                r._keep(body)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        r, self._resp = self._resp, None
        if r is not None:
            if not self._parser.should_keep_alive():
                self.closed = True  # not reusable; closed when released
            r._end(None)

    # -- ours ------------------------------------------------------------------------------
    def _fail(self, exc: BaseException) -> None:
        f = self._headers_done
        if f is not None and not f.done():
            f.set_exception(exc if isinstance(exc, ConnectionError) else UpstreamClosed(str(exc)))
        r, self._resp = self._resp, None
        if r is not None:
            r._end(exc)

    async def send(
        self, head: bytes, body: bytes, sent: Callable[[], None] | None = None
    ) -> UpstreamResponse:
        if self.closed or self.transport is None or self.transport.is_closing():
            raise UpstreamClosed("the connection closed while idle")
        r = self._resp = UpstreamResponse(self)
        self._headers_done = asyncio.get_running_loop().create_future()
        self.got_bytes = False
        self.transport.write(head + body if len(body) < 16384 else head)
        if len(body) >= 16384:
            self.transport.write(body)
        if sent is not None:
            sent()
        await self._headers_done
        return r

    def reusable(self) -> None:
        if self.closed or self.transport is None or self.transport.is_closing():
            self.close()
            return
        self.used = time.monotonic()
        self._upstream._park(self)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class Upstream:
    """The gateway's connections to its engines (one per process)."""

    def __init__(self, connect_timeout: float = 5.0) -> None:
        self.connect_timeout = connect_timeout
        self._origins: dict[str, _Origin] = {}
        self._idle: dict[_Origin, list[_Conn]] = {}
        self._ssl: ssl.SSLContext | None = None
        self.connects = 0  # new connections opened (the rest were reused)

    async def request(
        self,
        url: str,
        path: str,
        body: bytes,
        headers: dict[str, str],
        method: str = "POST",
        *,
        sent: Callable[[], None] | None = None,
    ) -> UpstreamResponse:
        """Send the request and return once the answer's headers are in (raises
        ConnectionError/OSError/TimeoutError on failure; time limits are the caller's).
        `sent` is called once the request's bytes are handed to the socket, before its
        answer is awaited: work that need not delay the engine goes there."""
        o = self._origins.get(url)
        if o is None:
            o = self._origins[url] = _origin(url)
        lines = [f"{method} {o.base}{path} HTTP/1.1\r\nHost: {o.host_header}\r\n"]
        for k, v in headers.items():
            lines.append(f"{k}: {v}\r\n")
        lines.append(f"Content-Length: {len(body)}\r\n\r\n")
        # aiohttp decodes request headers as UTF-8 with surrogateescape: the same bytes go on.
        head = "".join(lines).encode("utf-8", "surrogateescape")
        conn = self._take(o)
        if conn is not None:
            try:
                return await conn.send(head, body, sent)
            except ConnectionError:
                conn.close()
                if conn.got_bytes:
                    raise
                # Closed by the engine while idle: once more, on a new connection.
            except BaseException:
                conn.close()
                raise
        conn = await self._connect(o)
        try:
            return await conn.send(head, body, sent)
        except BaseException:
            conn.close()
            raise

    def _take(self, o: _Origin) -> _Conn | None:
        idle = self._idle.get(o)
        if not idle:
            return None
        now = time.monotonic()
        while idle:
            c = idle.pop()
            if not c.closed and now - c.used < IDLE_S:
                return c
            c.close()
        return None

    def _park(self, c: _Conn) -> None:
        idle = self._idle.setdefault(c.key, [])
        now = time.monotonic()
        if idle and now - idle[0].used >= IDLE_S:  # the oldest first: drop the stale
            keep = [x for x in idle if now - x.used < IDLE_S and not x.closed]
            for x in idle:
                if x not in keep:
                    x.close()
            idle[:] = keep
        if len(idle) >= _MAX_IDLE_PER_HOST:
            c.close()
            return
        idle.append(c)

    def _forget(self, c: _Conn) -> None:
        idle = self._idle.get(c.key)
        if idle and c in idle:
            idle.remove(c)

    async def _connect(self, o: _Origin) -> _Conn:
        loop = asyncio.get_running_loop()
        ctx = None
        if o.tls:
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            ctx = self._ssl
        async with asyncio.timeout(self.connect_timeout):
            _, proto = await loop.create_connection(
                lambda: _Conn(self, o),
                o.host,
                o.port,
                ssl=ctx,
                server_hostname=o.host if ctx else None,
            )
        self.connects += 1
        return proto

    def close(self) -> None:
        for idle in self._idle.values():
            for c in idle:
                with contextlib.suppress(Exception):
                    c.close()
        self._idle.clear()
