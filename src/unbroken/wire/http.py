"""aiohttp helpers shared by every server and client in unbroken."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import logging
import random
import re
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import aiohttp
import orjson
from aiohttp import HttpVersion11, web
from aiohttp.web_protocol import RequestHandler

from unbroken.wire.errors import ApiError, error_body, error_response

__all__ = [
    "BODY_LIMIT_HINT",
    "SSE_HEADERS",
    "Cors",
    "ServerLimits",
    "bearer_auth_middleware",
    "body_middleware",
    "client_session",
    "error_middleware",
    "free_port",
    "prepare_sse",
    "start_site",
    "wait_ok",
]

log = logging.getLogger(__name__)

# What a 413's message adds: which limit it was and how to raise it (set by the app).
BODY_LIMIT_HINT = web.AppKey("body_limit_hint", str)

SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",  # as vLLM (Starlette) sends it
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# A server going down answers /health 503 this long before its listener closes: a load
# balancer polling /health stops sending first, and requests that still arrive are served,
# not refused (the gateway's SIGTERM; the supervisor's stop budget counts it).
READINESS_LEAD_S = 0.5

_CORS_METHODS = "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT"


class Cors:
    """vLLM's CORS: Starlette's CORSMiddleware with `--allowed-origins` (vLLM 0.32's default
    `[]`: "cross-origin browser access is disabled by default"; `["*"]` for any origin),
    every method and header, no credentials. A preflight (OPTIONS with `Origin` and
    `Access-Control-Request-Method`) is answered on any path, as Starlette does: 200 for an
    allowed origin, 400 "Disallowed CORS origin" for any other (with no origin allowed, every
    preflight); every other answer to a request from an allowed origin says so
    (`on_prepare`, streams included)."""

    def __init__(self, origins: Sequence[str]) -> None:
        self.any = "*" in origins
        self.origins = frozenset(origins)

    def allows(self, origin: str) -> bool:
        return self.any or origin in self.origins

    def _origin_headers(self, origin: str) -> dict[str, str]:
        return (
            {"Access-Control-Allow-Origin": "*"}
            if self.any
            else {
                "Access-Control-Allow-Origin": origin,
                "Vary": "Origin",
            }
        )

    @web.middleware
    async def preflight(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        if (
            request.method != "OPTIONS"
            or origin is None
            or "Access-Control-Request-Method" not in request.headers
        ):
            return await handler(request)
        if not self.allows(origin):
            return web.Response(status=400, text="Disallowed CORS origin")
        headers = {
            **self._origin_headers(origin),
            "Access-Control-Allow-Methods": _CORS_METHODS,
            "Access-Control-Max-Age": "600",
        }
        if asked := request.headers.get("Access-Control-Request-Headers"):
            headers["Access-Control-Allow-Headers"] = asked
        return web.Response(status=200, text="OK", headers=headers)

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if (
            origin is not None
            and self.allows(origin)
            and "Access-Control-Allow-Origin" not in response.headers  # a preflight's own
        ):
            for k, v in self._origin_headers(origin).items():
                if k == "Vary":
                    response.headers.add(k, v)
                else:
                    response.headers[k] = v

    def install(self, app: web.Application) -> None:
        """Before the app starts: the preflight answer first of its middlewares."""
        app.middlewares.insert(0, self.preflight)
        if self.origins:
            app.on_response_prepare.append(self.on_prepare)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure leaves as an OpenAI error body; unexpected ones are logged as bugs."""
    try:
        return await handler(request)
    except ApiError as e:
        return e.response()
    except web.HTTPRequestEntityTooLarge as e:
        hint = request.app.get(BODY_LIMIT_HINT)
        return error_response(
            413,
            f"request body too large: {e.text}" + (f" ({hint})" if hint else ""),
            code="body_too_large",
        )
    except web.RequestPayloadError as e:
        # A body that cannot be read as sent (bad gzip, chunking cut short): the client's fault.
        why = " ".join(str(e).split())  # aiohttp's text spans two lines
        resp = error_response(400, f"unreadable request body: {why}", code="invalid_body")
        resp.force_close()
        # The connection closes after this answer: mark the body ended, or aiohttp's lingering
        # read of the rest re-raises the stored error and logs it as an unhandled traceback.
        request.content.feed_eof()
        log.info("400 on %s %s: unreadable request body (%s)", request.method, request.path, why)
        return resp
    except web.HTTPException as e:
        if e.status < 400:
            raise
        headers = {k: v for k, v in e.headers.items() if k.lower() in ("allow", "retry-after")}
        return error_response(e.status, e.reason or "error", headers=headers)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as e:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(500, f"internal error: {type(e).__name__}")


def bearer_auth_middleware(token: str) -> Callable[..., Awaitable[web.StreamResponse]]:
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        # Header values arrive as text that may hold undecodable bytes (surrogates):
        # encode them back as they came instead of failing on them.
        got = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(got, expected):
            raise ApiError(
                401,
                "missing or invalid admin bearer token",
                code="invalid_token",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return await handler(request)

    return auth


def body_middleware(timeout: float) -> Callable[..., Awaitable[web.StreamResponse]]:
    """Read the whole request body within `timeout` seconds before the handler runs (a body
    shorter than its Content-Length would otherwise hold the connection forever); the
    handler's own `read()` then returns the cached bytes."""

    @web.middleware
    async def read_body(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.body_exists:
            try:
                async with asyncio.timeout(timeout):
                    await request.read()
            except TimeoutError:
                resp = error_response(
                    408, f"the request body did not arrive within {timeout:g} s", code="timeout"
                )
                resp.force_close()
                # Sent and closed here: aiohttp would otherwise linger reading the rest.
                with contextlib.suppress(ConnectionError, RuntimeError):
                    await resp.prepare(request)
                    await resp.write_eof()
                if request.transport is not None:
                    request.transport.close()
                return resp
        return await handler(request)

    return read_body


async def prepare_sse(request: web.Request, status: int = 200) -> web.StreamResponse:
    resp = web.StreamResponse(status=status, headers=SSE_HEADERS)
    await resp.prepare(request)
    return resp


MAX_HEADER_LINE = 16 * 1024  # bytes of a request line or one header line


@dataclass(frozen=True)
class ServerLimits:
    """Connection-level limits aiohttp itself does not offer. `header_timeout_s`: a request's
    headers must be complete this long after its first byte (or after the connection opens),
    else the connection is closed with 408 (slowloris). `max_connections_per_client`: open
    connections per client address beyond this get 429 and are closed."""

    header_timeout_s: float | None = None
    max_connections_per_client: int | None = None


def _raw_error(status: int, reason: str, message: str, code: str) -> bytes:
    """A complete HTTP/1.1 error response for a connection no request handler owns."""
    body = orjson.dumps(error_body(message, type=_error_type(status), code=code))
    return (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body


def _error_type(status: int) -> str:
    return ApiError(status, "").type


class _Handler(RequestHandler):
    """aiohttp's protocol with OpenAI-format bodies for the parser's own errors, a header
    timeout and a per-address connection cap."""

    _limits: ServerLimits
    _per_client: dict[str, int]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        srv = self._manager
        self._limits = getattr(srv, "limits", ServerLimits())
        self._per_client = getattr(srv, "per_client", {})
        self._header_timer: asyncio.TimerHandle | None = None
        self._client: str | None = None
        self._refused = False
        self._header_started = False
        self._last_payload: Any = None  # the body stream of the last request parsed
        peer = transport.get_extra_info("peername")
        if self._limits.max_connections_per_client is not None and peer:
            host = str(peer[0]) if isinstance(peer, tuple) else str(peer)
            n = self._per_client.get(host, 0) + 1
            self._per_client[host] = n
            self._client = host
            if n > self._limits.max_connections_per_client:
                log.warning("refusing connection %d from %s (over the per-client cap)", n, host)
                cap = self._limits.max_connections_per_client
                t = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
                t.write(
                    _raw_error(
                        429,
                        "Too Many Requests",
                        f"too many open connections from this address (limit {cap})",
                        "too_many_connections",
                    )
                )
                # Half-close and linger: closing with the client's request unread would
                # reset the connection and lose the answer.
                self._refused = True
                with contextlib.suppress(Exception):
                    t.write_eof()
                self._loop.call_later(2.0, t.close)
                return
        self._arm_header_timer()

    def _arm_header_timer(self, started: bool = False) -> None:
        if self._header_timer is not None:  # the deadline stands; note that bytes came
            self._header_started = self._header_started or started
        elif self._limits.header_timeout_s is not None:
            self._header_started = started
            self._header_timer = self._loop.call_later(
                self._limits.header_timeout_s, self._header_timeout
            )

    def _header_timeout(self) -> None:
        self._header_timer = None
        t = self.transport
        if t is None or t.is_closing() or self._current_request is not None:
            return
        if not self._header_started:
            t.close()  # opened and never used: no answer owed (a client pool retries)
            return
        t.write(
            _raw_error(
                408,
                "Request Timeout",
                f"request headers not received within {self._limits.header_timeout_s:g} s",
                "timeout",
            )
        )
        t.close()

    def data_received(self, data: bytes) -> None:
        if getattr(self, "_refused", False) or not hasattr(self, "_limits"):
            if not hasattr(self, "_limits"):
                super().data_received(data)
            return
        before = self._request_count
        # Judged before parsing: these bytes may be the end of the last request's body.
        in_body = self._last_payload is not None and not self._last_payload.is_eof()
        super().data_received(data)
        if not hasattr(self, "_limits"):
            return
        if self._request_count != before:
            if self._header_timer is not None:  # a request's headers are complete
                self._header_timer.cancel()
                self._header_timer = None
            self._last_payload = self._messages[-1][1] if self._messages else None
        elif data and not in_body:  # (aiohttp re-feeds b"" after pausing)
            # Bytes outside any request body: the first of the next request's headers.
            self._arm_header_timer(started=True)

    def connection_lost(self, exc: BaseException | None) -> None:
        if getattr(self, "_header_timer", None) is not None:
            self._header_timer.cancel()  # type: ignore[union-attr]
            self._header_timer = None
        if getattr(self, "_client", None) is not None:
            host = self._client
            assert host is not None
            left = self._per_client.get(host, 1) - 1
            if left > 0:
                self._per_client[host] = left
            else:
                self._per_client.pop(host, None)
            self._client = None
        super().connection_lost(exc)

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """Errors raised before any handler runs (the HTTP parser's): an OpenAI error body
        instead of aiohttp's plain text."""
        if request.writer.output_size > 0:
            raise ConnectionError("response already started; cannot send an error")
        log.debug("bad request from %s: %s", request.remote, exc or message)
        if status >= 500:
            text = "internal error"
            code = "internal_error"
        else:
            detail = str(message or exc or "bad request").strip().splitlines()[0]
            # aiohttp's parser quotes what it read (`... when reading: b'...'`): a header's
            # value, which may be a bearer token. Say what was wrong, not what was sent.
            detail = re.split(r":? b['\"]", detail, maxsplit=1)[0].rstrip(": ")[:200]
            text = f"malformed HTTP request: {detail}"
            code = "bad_http_request"
        resp = error_response(status, text, code=code, headers={"Server": "unbroken"})
        resp.force_close()
        # The parser failed before it read the version, so aiohttp would answer HTTP/1.0;
        # answer in 1.1, as uvicorn does and as the client spoke.
        if hasattr(request, "_version"):
            request._version = HttpVersion11
            getattr(request, "_cache", {}).pop("version", None)  # `version` is a reify
        return resp


class _Server(web.Server):
    limits: ServerLimits
    per_client: dict[str, int]

    def __call__(self) -> RequestHandler:
        return _Handler(self, loop=self._loop, **self._kwargs)


async def _server_header(request: web.Request, resp: web.StreamResponse) -> None:
    # aiohttp would add its own (with its and Python's versions); set first, it is kept.
    resp.headers["Server"] = "unbroken"


async def start_site(
    app: web.Application,
    host: str,
    port: int,
    *,
    sock: socket.socket | None = None,
    shutdown_timeout: float = 2.0,
    limits: ServerLimits | None = None,
    site_for: Callable[[web.AppRunner], web.BaseSite] | None = None,
) -> web.AppRunner:
    """Start serving; `handler_cancellation` makes a client disconnect cancel its handler,
    which is how an engine frees a slot while a request is still queued or prefilling.
    `site_for` makes the site (the gateway's workers: accepts balanced between them)."""
    if not app.frozen:
        app.on_response_prepare.append(_server_header)
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=shutdown_timeout,
        # uvicorn (vLLM's server) takes a header block of up to 16 KiB; aiohttp's 8 KiB a line
        # refused a client's long session header or token with 400 where vLLM would answer.
        max_line_size=MAX_HEADER_LINE,
        max_field_size=MAX_HEADER_LINE,
    )
    await runner.setup()
    server = runner.server
    assert server is not None
    server.__class__ = _Server  # the same object, making our protocol subclass
    server.limits = limits or ServerLimits()  # type: ignore[attr-defined]
    server.per_client = {}  # type: ignore[attr-defined]
    site: web.BaseSite
    if site_for is not None:
        site = site_for(runner)
    elif sock is not None:
        site = web.SockSite(runner, sock)
    else:
        site = web.TCPSite(runner, host, port, backlog=4096, reuse_address=True)
    await site.start()
    return runner


def client_session(
    *, connect_timeout: float = 5.0, read_timeout: float | None = None, limit: int = 0
) -> aiohttp.ClientSession:
    """One session per process. No total timeout (it would cut long streams); bounded
    connect, and a read bound where the caller has one."""
    timeout = aiohttp.ClientTimeout(
        total=None, sock_connect=connect_timeout, connect=connect_timeout, sock_read=read_timeout
    )
    connector = aiohttp.TCPConnector(limit=limit, ttl_dns_cache=300, enable_cleanup_closed=True)
    return aiohttp.ClientSession(
        timeout=timeout, connector=connector, auto_decompress=False, raise_for_status=False
    )


_HANDED: collections.deque[int] = collections.deque(maxlen=256)
_PICK = random.Random()  # its own generator: a caller's random.seed() must not repeat ports
PORT_FLOOR = 10_000  # below: well-known services' habits (and root-only under 1024)


def _ephemeral_floor() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, for a server this process is about to start, and not one it handed
    out recently. Picked at random below the kernel's ephemeral range: a port the kernel
    hands to `bind(port 0)` is one it also gives to outgoing connections, so between this
    check and the server's bind another process's client could take it (the suite on two
    workers met exactly that: a gateway that could not listen), and two binds in a row can
    get the same one (a gateway once got its public and admin ports equal). Falls back to
    the kernel's choice where the range below is too small."""
    top = _ephemeral_floor()
    for _ in range(50):
        if top - PORT_FLOOR >= 1_000:
            port = _PICK.randrange(PORT_FLOOR, top)
        else:
            port = 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            port = int(s.getsockname()[1])
        if port not in _HANDED:
            break
    else:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
    _HANDED.append(port)
    return port


async def wait_ok(
    session: aiohttp.ClientSession,
    url: str,
    *,
    timeout: float,
    interval: float = 0.05,
    check: Callable[[], None] | None = None,
) -> float:
    """GET `url` until it answers 200; return the seconds that took. Refused connections and
    other statuses mean "not yet". `check` runs before every try and raises to give up early
    (the process that should answer has exited); TimeoutError after `timeout` seconds."""
    t0 = time.monotonic()
    while True:
        if check is not None:
            check()
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=1)) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except (aiohttp.ClientError, TimeoutError, ConnectionError):
            pass
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{url} did not answer 200 within {timeout:.0f} s")
        await asyncio.sleep(interval)
