"""Issue 21, findings 2 and 3: an engine that violates the SSE/OpenAI protocol (non-JSON
events, events that are not completion chunks, no blank line between events, one huge line,
a 200 that is not a stream) is a broken leg: the client gets only well-formed OpenAI SSE and
the simulator's exact text, continued on the healthy engine, promptly; the decoder is linear
in the bytes fed and bounded in event size."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web

from helpers import MODEL, Proc, admin, engine, gateway
from unbroken.engine.textmodel import expected_completion
from unbroken.wire.http import free_port
from unbroken.wire.sse import EventTooLarge, SSEDecoder, encode_json

# -- the decoder ---------------------------------------------------------------------------


def test_decoder_is_linear_on_one_long_line() -> None:
    """50 MB of one line in 64 KB reads: the old decoder re-searched the whole buffer on
    every read (quadratic, tens of seconds); with no bound it must still be quick."""
    d = SSEDecoder(max_event=None)
    piece = b"x" * 65536
    t = time.perf_counter()
    assert d.feed(b"data: ") == []
    for _ in range(50 * 1024 * 1024 // len(piece)):
        assert d.feed(piece) == []
    evs = d.feed(b"\n\n")
    took = time.perf_counter() - t
    assert len(evs) == 1 and len(evs[0].data or b"") == 50 * 1024 * 1024
    assert took < 5.0, took


def test_decoder_bounds_event_size() -> None:
    d = SSEDecoder(max_event=1024)
    assert [e.data for e in d.feed(b"data: a\n\n")] == [b"a"]
    with pytest.raises(EventTooLarge):
        for _ in range(100):
            d.feed(b"y" * 100)
    with pytest.raises(EventTooLarge):  # a whole oversize event in one read
        SSEDecoder(max_event=1024).feed(b"data: " + b"z" * 2000 + b"\n\n")
    assert d.pending == 0  # nothing kept after the break


def test_decoder_marks_plain_events() -> None:
    evs = SSEDecoder().feed(b"data: {}\n\nevent: x\ndata: {}\n\n")
    assert [e.plain for e in evs] == [True, False]


# -- misbehaving engines through a real gateway --------------------------------------------


class BadEngine:
    """Stands in for an engine (or a proxy in front of one) that violates the protocol on
    real requests while answering /health, /v1/models and the gateway's warm-up correctly.
    `mode`: "notjson" (`data: {not json` events), "nonchunk" (JSON
    that is not a completion chunk), "noblank" (never the blank line between events),
    "huge" (one 200 MB line), "html" (a 200 text/html page)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.port = free_port()
        self.hits = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/health", self._ok)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._complete)
        runner = web.AppRunner(app)
        self._loop.run_until_complete(runner.setup())
        self._loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()

    async def _ok(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        obj = orjson.loads(await request.read())
        prompt = obj.get("prompt")
        n = int(obj.get("max_tokens") or 16)
        exp = expected_completion(prompt, n)
        base = {"id": "cmpl-bad", "object": "text_completion", "created": 1, "model": MODEL}
        pieces = re.findall(r" ?\S+", exp.text)  # the simulator's tokens are words

        def chunk(i: int, text: str, fin: str | None) -> bytes:
            ch = {"index": 0, "text": text, "logprobs": None, "finish_reason": fin}
            return encode_json({**base, "choices": [ch]})

        warm = prompt == "warm up" or not obj.get("stream")
        if warm:
            ch = {"index": 0, "text": exp.text, "logprobs": None, "finish_reason": "length"}
            usage = {"prompt_tokens": 2, "completion_tokens": n, "total_tokens": n + 2}
            if obj.get("stream"):
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                await resp.write(encode_json({**base, "choices": [ch]}) + b"data: [DONE]\n\n")
                await resp.write_eof()
                return resp
            return web.json_response({**base, "choices": [ch], "usage": usage})
        self.hits += 1
        if self.mode == "html":
            return web.Response(text="<html>busy</html>", content_type="text/html")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            if self.mode == "huge":
                await resp.write(b"data: ")
                block = b"x" * 65536
                for _ in range(200 * 16):
                    await resp.write(block)
                return resp
            if self.mode == "noblank":
                for i, p in enumerate(pieces):
                    await resp.write(chunk(i, p, None)[:-1])
                    await asyncio.sleep(0.001)
                await resp.write(b"data: [DONE]\n")
                return resp
            bad = b"data: {not json\n\n" if self.mode == "notjson" else b'data: {"x": 1}\n\n'
            for _ in range(50):
                await resp.write(bad)
                await asyncio.sleep(0.001)
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionError, RuntimeError):
            pass
        return resp

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


@pytest.fixture(scope="module")
def good(logdir: Path) -> Iterator[Proc]:
    p = engine(logdir, name="good")
    yield p
    p.stop()


def _raw_stream(url: str, body: dict[str, Any], timeout: float = 30.0) -> tuple[int, list[bytes]]:
    """Every event's data as the client receives it (raw SSE parsing, no leniency)."""
    datas: list[bytes] = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, [r.content]
        assert r.headers["content-type"].startswith("text/event-stream")
        buf = b""
        for c in r.iter_raw():
            buf += c
            while b"\n\n" in buf:
                ev, buf = buf.split(b"\n\n", 1)
                for line in ev.split(b"\n"):
                    assert line.startswith((b"data: ", b":")), line[:100]
                    if line.startswith(b"data: "):
                        datas.append(line[6:])
        assert buf == b""
    return 200, datas


@pytest.mark.parametrize("mode", ["notjson", "nonchunk", "noblank", "huge", "html"])
def test_protocol_violation_is_a_broken_leg(logdir: Path, good: Proc, mode: str) -> None:
    bad = BadEngine(mode)
    g = gateway(logdir, bad.url, good.url, name=f"gw-{mode}")
    try:
        for i in range(4):  # both endpoints get requests
            prompt = f"violate {mode} {i}"
            t = time.monotonic()
            status, datas = _raw_stream(
                g.url,
                {
                    "model": MODEL,
                    "prompt": prompt,
                    "max_tokens": 20,
                    "temperature": 0,
                    "stream": True,
                },
            )
            took = time.monotonic() - t
            assert status == 200, datas
            assert datas[-1] == b"[DONE]"
            text = ""
            for d in datas[:-1]:
                obj = orjson.loads(d)  # every event the client gets is JSON
                assert isinstance(obj, dict) and "error" not in obj, obj
                text += "".join(c.get("text") or "" for c in obj["choices"])
            assert text == expected_completion(prompt, 20).text
            assert took < 10.0, took
        assert bad.hits >= 1
        # The healthy engine stayed in rotation (its /health was answered in time).
        eps = admin(g, "GET", "/admin/endpoints").json()["endpoints"]
        assert any(e["url"].rstrip("/") == good.url and e["state"] == "ready" for e in eps), eps
    finally:
        g.stop()
        bad.close()
