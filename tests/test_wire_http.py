"""wait_ok: the one "poll until 200" loop behind the supervisor's health wait and the
benchmarks, against a real server on a real socket."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web

from unbroken.wire.http import free_port, start_site, wait_ok


async def test_wait_ok_waits_through_refusals_and_errors() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/health"
    calls = 0

    async def health(request: web.Request) -> web.Response:
        nonlocal calls
        calls += 1
        return web.Response(status=200 if calls >= 3 else 503)

    app = web.Application()
    app.router.add_get("/health", health)
    async with aiohttp.ClientSession() as s:
        # Nothing listening yet: refused connections are "not yet", until the timeout.
        with pytest.raises(TimeoutError, match="did not answer 200"):
            await wait_ok(s, url, timeout=0.2, interval=0.02)
        runner = await start_site(app, "127.0.0.1", port)
        try:
            took = await wait_ok(s, url, timeout=5, interval=0.01)
            assert calls == 3 and 0 <= took < 5

            def dead() -> None:
                raise RuntimeError("process exited")

            with pytest.raises(RuntimeError, match="process exited"):
                await wait_ok(s, url, timeout=5, check=dead)
        finally:
            await runner.cleanup()


def test_free_port_is_outside_the_ephemeral_range_unrepeated_and_bindable() -> None:
    """Ports from the kernel's ephemeral range can be taken by another process's outgoing
    connection between the pick and the server's bind (the suite on two workers hit it)."""
    import socket
    from pathlib import Path

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    if low - 10_000 >= 1_000:
        assert all(10_000 <= p < low for p in ports), (low, min(ports), max(ports))
    for p in ports[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
