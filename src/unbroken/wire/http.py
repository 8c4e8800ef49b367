"""aiohttp helpers shared by every server and client in unbroken."""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
import time
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web

from unbroken.wire.errors import ApiError, error_response

__all__ = [
    "SSE_HEADERS",
    "bearer_auth_middleware",
    "client_session",
    "error_middleware",
    "free_port",
    "prepare_sse",
    "start_site",
    "wait_ok",
]

log = logging.getLogger(__name__)

SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure leaves as an OpenAI error body; unexpected ones are logged as bugs."""
    try:
        return await handler(request)
    except ApiError as e:
        return e.response()
    except web.HTTPRequestEntityTooLarge as e:
        return error_response(413, f"request body too large: {e.text}", code="body_too_large")
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
        got = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(got, expected):
            raise ApiError(
                401,
                "missing or invalid admin bearer token",
                code="invalid_token",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return await handler(request)

    return auth


async def prepare_sse(request: web.Request, status: int = 200) -> web.StreamResponse:
    resp = web.StreamResponse(status=status, headers=SSE_HEADERS)
    await resp.prepare(request)
    return resp


async def start_site(
    app: web.Application,
    host: str,
    port: int,
    *,
    sock: socket.socket | None = None,
    shutdown_timeout: float = 2.0,
) -> web.AppRunner:
    """Start serving; `handler_cancellation` makes a client disconnect cancel its handler,
    which is how an engine frees a slot while a request is still queued or prefilling."""
    runner = web.AppRunner(
        app, handler_cancellation=True, access_log=None, shutdown_timeout=shutdown_timeout
    )
    await runner.setup()
    site: web.BaseSite
    if sock is not None:
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


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


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
