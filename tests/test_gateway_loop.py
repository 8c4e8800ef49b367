"""What holds up the gateway's event loop.

New work before later tokens (`gateway/_later.py`): when one pass of the gateway's event
loop reads a new stream's first event and another stream's later tokens, the new stream's
first event is written to its client before the other stream's tokens are taken in.

A real simulator engine in its own process; the gateway in this process on uvloop (as
`unbroken gateway` runs it), so that its event loop can be held: while it is held (a
blocking sleep in the loop's thread) the engine produces the new stream's first token and
the old stream's next ones, and when it runs again one poll reports both sockets. Which
client each write went to is recorded by wrapping the gateway's two write paths to clients
(`ClientSink.send_nowait`, `SSEResponse.write`): an observation of real writes on real
sockets, nothing replaced. Before the change, the old stream's tokens were decoded and
written inside the read callback, and the new stream's first event (written by its task,
with the response headers) after all of them.

No reference cycles per request: what a request allocates is freed by reference counting.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import orjson
import uvloop

from helpers import MODEL, engine
from unbroken.config.spec import GatewaySettings
from unbroken.gateway._pool import State
from unbroken.gateway._relay import ClientSink, SSEResponse
from unbroken.gateway._server import Gateway, StaticEndpoint
from unbroken.wire.http import free_port


async def _client(port: int, body: dict[str, Any]) -> tuple[int, asyncio.Task[bytes]]:
    """A raw HTTP client: its local port (the gateway's peer) and a task reading all."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = orjson.dumps(body)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n%b" % (len(data), data)
    )

    async def read() -> bytes:
        try:
            return await reader.read()
        finally:
            writer.close()

    return writer.get_extra_info("sockname")[1], asyncio.create_task(read())


async def _serve(gw: Gateway, url: str) -> None:
    """Start `gw` in front of the engine at `url` and wait until it is ready there."""
    await gw.start([StaticEndpoint(url)])
    for _ in range(400):
        if any(x.state == State.READY for x in gw.pool.endpoints.values()):
            return
        await asyncio.sleep(0.025)
    raise AssertionError("the engine never became ready behind the gateway")


async def _scenario(url: str) -> tuple[list[int], int, int, bytes, bytes]:
    writes: list[int] = []  # the client (its port) of each write, in order

    def peer(transport: Any) -> int:
        return transport.get_extra_info("peername")[1] if transport is not None else -1

    send_nowait, write = ClientSink.send_nowait, SSEResponse.write

    def rec_send_nowait(self: ClientSink, data: bytes) -> bool:
        ok = send_nowait(self, data)
        if ok:
            writes.append(peer(self.transport))
        return ok

    async def rec_write(self: SSEResponse, data: bytes) -> None:
        req = self._req
        writes.append(peer(req.transport if req is not None else None))
        await write(self, data)

    gw = Gateway(GatewaySettings(port=free_port(), admin_port=free_port()), "token")
    ClientSink.send_nowait = rec_send_nowait  # type: ignore[method-assign]
    SSEResponse.write = rec_write  # type: ignore[method-assign]
    try:
        await _serve(gw, url)
        a_port, a = await _client(
            gw.port, {"model": MODEL, "prompt": "go", "max_tokens": 200, "stream": True}
        )
        while writes.count(a_port) < 5:  # A streams
            await asyncio.sleep(0.01)
        prompt = " ".join(f"w{i}" for i in range(300))  # ~0.65 s of prefill
        b_port, b = await _client(
            gw.port, {"model": MODEL, "prompt": prompt, "max_tokens": 2, "stream": True}
        )
        await asyncio.sleep(0.2)  # B is at the engine, in its prefill
        assert b_port not in writes, "B's first token came before the hold: prefill too short"
        mark = len(writes)
        # The loop held: B's first token and A's next ones wait for it.
        time.sleep(1.0)  # noqa: ASYNC251
        got_a, got_b = await asyncio.wait_for(asyncio.gather(a, b), 20)
        return writes[mark:], a_port, b_port, got_a, got_b
    finally:
        ClientSink.send_nowait = send_nowait  # type: ignore[method-assign]
        SSEResponse.write = write  # type: ignore[method-assign]
        await gw.stop()


def test_a_first_token_is_written_before_later_tokens_read_in_the_same_pass(
    tmp_path: Path,
) -> None:
    # Steps of 20 ms; B's prompt of ~300 tokens prefills in ~0.65 s.
    e = engine(
        tmp_path,
        "--decode-base-s",
        "0.02",
        "--decode-per-seq-s",
        "0",
        "--prefill-per-token-s",
        "0.002",
        fast=False,
    )
    try:
        after, a_port, b_port, got_a, got_b = uvloop.run(_scenario(e.url))
    finally:
        e.stop()
    assert after and after[0] == b_port, (
        f"after the hold, writes went to {['B' if p == b_port else 'A' for p in after[:12]]}"
    )
    assert after.count(a_port) >= 5  # A's tokens of the held second came after it
    # Both streams whole.
    assert got_b.count(b'"finish_reason":"length"') == 1 and b"data: [DONE]" in got_b
    assert got_a.count(b'"finish_reason":"length"') == 1 and b"data: [DONE]" in got_a


async def _garbage_per_request(url: str, n: int) -> float:
    import gc

    import aiohttp

    gw = Gateway(GatewaySettings(port=free_port(), admin_port=free_port()), "token")
    try:
        await _serve(gw, url)
        async with aiohttp.ClientSession() as s:

            async def one(i: int) -> None:
                body = {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": f"hi {i}"}],
                    "max_tokens": 8,
                    "stream": i % 2 == 0,
                }
                url = f"http://127.0.0.1:{gw.port}/v1/chat/completions"
                async with s.post(url, json=body) as r:
                    await r.read()
                    assert r.status == 200

            await asyncio.gather(*(one(i) for i in range(10)))  # warm: pools, caches
            gc.collect()
            gc.disable()
            try:
                await asyncio.gather(*(one(i) for i in range(n)))
                await asyncio.sleep(0.2)
                return gc.collect() / n
            finally:
                gc.enable()
    finally:
        await gw.stop()


def test_a_request_leaves_no_reference_cycles(tmp_path: Path) -> None:
    """What a request allocates is freed by reference counting, not left to the cyclic
    collector, whose collections stop the event loop (in the demo's steady window they took
    ~2 ms, twice a second, in the busy gateway worker). The first-byte watch was a closure
    that scheduled itself, a cycle that took the request's task, its time limit and their
    contexts with it: 18 objects a request."""
    e = engine(tmp_path)
    try:
        per_request = uvloop.run(_garbage_per_request(e.url, 100))
    finally:
        e.stop()
    assert per_request < 1.0, f"{per_request:.1f} objects a request left to the cyclic collector"


def test_held_work_runs_in_order_after_the_pass_and_survives_a_failing_item(
    caplog: Any,
) -> None:
    """`Later` on a real uvloop loop: what is held runs after the callbacks the pass made
    due, in the order held, and one item that raises is logged without stopping the rest
    (each is another stream's chunk)."""
    from unbroken.gateway._later import for_loop

    order: list[str] = []

    def boom(_: object) -> None:
        raise RuntimeError("one stream's fault")

    async def main() -> None:
        loop = asyncio.get_running_loop()
        later = for_loop(loop)
        later.hold(order.append, "held 1")
        later.hold(boom, None)
        loop.call_soon(order.append, "due in the pass")
        later.hold(order.append, "held 2")
        await asyncio.sleep(0.01)

    uvloop.run(main())
    assert order == ["due in the pass", "held 1", "held 2"]
    assert "relaying a held chunk failed" in caplog.text
