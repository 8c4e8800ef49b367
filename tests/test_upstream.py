"""The gateway's HTTP/1.1 client to the engines (`gateway/_upstream.py`), against raw
asyncio servers on real sockets that answer byte for byte what each case needs."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from unbroken.gateway._upstream import IDLE_S, Upstream, UpstreamClosed

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _serve(handler: Handler) -> tuple[asyncio.Server, str, list[int]]:
    """A server; the list counts the connections it accepted."""
    conns: list[int] = []

    async def on_conn(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        conns.append(1)
        try:
            await handler(r, w)
        finally:
            w.close()

    srv = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    return srv, f"http://127.0.0.1:{port}", conns


async def _read_request(r: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await r.readuntil(b"\r\n\r\n")
    n = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            n = int(line.split(b":", 1)[1])
    return head, await r.readexactly(n)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


async def test_keep_alive_reuses_one_connection_and_sends_the_request_whole() -> None:
    seen: list[tuple[bytes, bytes]] = []

    async def h(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            try:
                head, body = await _read_request(r)
            except asyncio.IncompleteReadError:
                return
            seen.append((head, body))
            w.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n")
            w.write(b"Content-Length: 2\r\n\r\n{}")
            await w.drain()

    srv, url, conns = await _serve(h)
    up = Upstream()
    try:
        for i in range(3):
            resp = await up.request(url, "/v1/x", b'{"i":%d}' % i, {"X-Request-ID": "r1"})
            assert resp.status == 200 and resp.content_type == "application/json"
            assert await resp.read() == b"{}"
        assert len(conns) == 1 and up.connects == 1
        head, body = seen[2]
        assert head.startswith(b"POST /v1/x HTTP/1.1\r\n")
        assert f"Host: {url.removeprefix('http://')}\r\n".encode() in head
        assert b"X-Request-ID: r1\r\n" in head and body == b'{"i":2}'
    finally:
        up.close()
        srv.close()


async def test_a_stream_is_delivered_in_the_read_callback_then_its_end() -> None:
    async def h(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n")  # fmt: skip
        for i in range(5):
            w.write(_chunk(b"data: %d\n\n" % i))
            await w.drain()
            await asyncio.sleep(0.01)
        w.write(b"0\r\n\r\n")
        await w.drain()
        await asyncio.sleep(1)

    srv, url, _ = await _serve(h)
    up = Upstream()
    try:
        resp = await up.request(url, "/s", b"{}", {})
        got: list[bytes] = []
        ended: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()
        resp.stream(got.append, ended.set_result)
        assert await asyncio.wait_for(ended, 5) is None
        assert b"".join(got) == b"".join(b"data: %d\n\n" % i for i in range(5))
        resp.release()
        assert up._idle  # complete: the connection went back to the pool
    finally:
        up.close()
        srv.close()


async def test_a_connection_closed_while_idle_is_replaced_without_an_error() -> None:
    """The engine closes an idle keep-alive connection (uvicorn after 5 s); the next request
    on it must not fail the endpoint."""

    async def h(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await w.drain()
        # and close right after, as a server whose keep-alive expired does

    srv, url, conns = await _serve(h)
    up = Upstream()
    try:
        r1 = await up.request(url, "/a", b"", {})
        assert await r1.read() == b"ok"
        await asyncio.sleep(0.05)
        r2 = await up.request(url, "/a", b"", {})
        assert await r2.read() == b"ok"
        assert len(conns) == 2
    finally:
        up.close()
        srv.close()


async def test_stale_idle_connections_are_not_used() -> None:
    async def h(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            try:
                await _read_request(r)
            except asyncio.IncompleteReadError:
                return
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
            await w.drain()

    srv, url, conns = await _serve(h)
    up = Upstream()
    try:
        await (await up.request(url, "/", b"", {})).read()
        for conns_ in up._idle.values():
            for c in conns_:
                c.used -= IDLE_S + 1  # as if idle for longer than IDLE_S
        await (await up.request(url, "/", b"", {})).read()
        assert len(conns) == 2
    finally:
        up.close()
        srv.close()


async def test_interim_100_continue_and_a_body_ended_by_close() -> None:
    async def h(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _read_request(r)
        w.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        w.write(b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\n\r\nbusy, try later")
        await w.drain()

    srv, url, _ = await _serve(h)
    up = Upstream()
    try:
        resp = await up.request(url, "/", b"{}", {})
        assert resp.status == 503
        assert await resp.read() == b"busy, try later"
        assert not up._idle.get(next(iter(up._origins.values())))  # Connection: close
    finally:
        up.close()
        srv.close()


async def test_a_reset_mid_stream_and_garbage_are_errors_not_hangs() -> None:
    async def reset(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + _chunk(b"data: 1\n\n"))
        await w.drain()
        await asyncio.sleep(0.05)
        w.transport.abort()

    async def garbage(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await _read_request(r)
        w.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        await w.drain()
        await asyncio.sleep(1)

    srv, url, _ = await _serve(reset)
    srv2, url2, _ = await _serve(garbage)
    up = Upstream()
    try:
        resp = await up.request(url, "/", b"{}", {})
        got: list[bytes] = []
        ended: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()
        resp.stream(got.append, ended.set_result)
        exc = await asyncio.wait_for(ended, 5)
        assert isinstance(exc, ConnectionError) and got == [b"data: 1\n\n"]
        with pytest.raises(UpstreamClosed, match="malformed HTTP"):
            await asyncio.wait_for(up.request(url2, "/", b"{}", {}), 5)
    finally:
        up.close()
        srv.close()
        srv2.close()


async def test_refused_connection_raises_an_os_error() -> None:
    srv, url, _ = await _serve(lambda r, w: asyncio.sleep(0))
    srv.close()
    await srv.wait_closed()
    up = Upstream(connect_timeout=2.0)
    with pytest.raises(OSError):
        await up.request(url, "/", b"", {})
