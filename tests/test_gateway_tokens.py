"""Token-exact continuation, deterministically: a vLLM-shaped engine (several tokens per SSE
event, continuous usage, `return_token_ids`, `finish_reason: "abort"` when it is told to
die) on real sockets, since real vLLM's aborts depend on timing (real vLLM is in tests/vllm/).
The stand-in's "greedy" output is a function of the token position, so a continuation that
resumes from the right ids with the right budget reproduces the undisturbed stream exactly.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from helpers import Proc, gateway, metric, stream
from unbroken.wire.http import free_port

MODEL = "fake"
PROMPT_IDS = {"/v1/completions": [1, 2, 3], "/v1/chat/completions": [1, 7, 8, 9, 2]}


def tok(pos: int) -> str:
    return f"<{100 + pos}>"


class FakeVllm:
    """Emits token 100+position as "<id>", `per_event` tokens per event; with `die_after`,
    ends every stream with finish_reason "abort" after that many tokens (a shutdown)."""

    def __init__(self, die_after: int | None = None, per_event: int = 3) -> None:
        self.die_after = die_after
        self.per_event = per_event
        self.suffix = ""  # appended to non-streamed answers: an engine that disagrees
        self.old = False  # an engine without `return_token_ids` (400 for it)
        # Tokens that end inside a character: their text is held back until the next token
        # (and lost if the stream aborts first); /detokenize ends in U+FFFD after one.
        self.partial: set[int] = set()
        self.port = free_port()
        self.bodies: list[tuple[str, dict[str, Any]]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        ready = threading.Event()
        threading.Thread(target=self._serve, args=(ready,), daemon=True).start()
        assert ready.wait(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _serve(self, ready: threading.Event) -> None:
        self._loop = asyncio.new_event_loop()
        app = web.Application()

        async def text(_: web.Request) -> web.Response:
            return web.Response(text="ok")

        async def models(_: web.Request) -> web.Response:
            return web.json_response(
                {"data": [{"id": MODEL, "object": "model", "owned_by": "vllm"}]}
            )

        app.router.add_get("/health", text)
        app.router.add_get("/metrics", text)
        app.router.add_get("/v1/models", models)

        async def detokenize(request: web.Request) -> web.Response:
            ids = (await request.json())["tokens"]
            text = "".join(f"<{t}>" for t in ids if t >= 100)
            if ids and ids[-1] in self.partial:
                text = text[: -len(f"<{ids[-1]}>")] + "\ufffd"
            return web.json_response({"prompt": text})

        app.router.add_post("/detokenize", detokenize)
        app.router.add_post("/v1/completions", self._gen)
        app.router.add_post("/v1/chat/completions", self._gen)

        async def start() -> None:
            self._runner = web.AppRunner(app)
            await self._runner.setup()
            await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

        self._loop.run_until_complete(start())
        ready.set()
        self._loop.run_forever()

    async def _gen(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        path = request.path
        self.bodies.append((path, body))
        bad = "return_token_ids" in body and self.old
        if bad or not isinstance(body.get("max_tokens", 0), int):  # 400s as vLLM's
            return web.json_response({"error": {"message": "bad", "code": 400}}, status=400)
        chat = path.endswith("chat/completions")
        prompt = body.get("prompt")
        ids = list(prompt) if isinstance(prompt, list) else list(PROMPT_IDS[path])
        n = int(body.get("max_tokens") or 16)
        if not body.get("stream"):
            text = "".join(tok(len(ids) + i) for i in range(n)) + self.suffix
            choice = {"index": 0, "finish_reason": "length"}
            choice.update({"message": {"content": text}} if chat else {"text": text})
            return web.json_response({"id": "x", "choices": [choice], "usage": {}})
        so = body.get("stream_options") or {}
        want_ids = bool(body.get("return_token_ids"))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        rid = "chatcmpl-1" if chat else "cmpl-1"
        kind = "chat.completion.chunk" if chat else "text_completion"

        held: list[str] = []

        def event(new: list[int], done: int, finish: str | None, first: bool) -> bytes:
            out = []
            for t in new:
                held.append(f"<{t}>")
                if t not in self.partial or (finish and finish != "abort" and t == new[-1]):
                    out += held
                    held.clear()
            text = "".join(out)
            ch: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
            if chat:
                ch["delta"] = {"content": text}
            else:
                ch["text"] = text
                ch["prompt_token_ids"] = ids if (want_ids and first) else None
            ch["token_ids"] = new if want_ids else None
            obj: dict[str, Any] = {"id": rid, "object": kind, "created": 1, "model": MODEL}
            obj["choices"] = [ch]
            if chat and first:
                obj["prompt_token_ids"] = ids if want_ids else None
            if so.get("continuous_usage_stats"):
                obj["usage"] = {
                    "prompt_tokens": len(ids),
                    "completion_tokens": done,
                    "total_tokens": len(ids) + done,
                }
            return b"data: " + orjson.dumps(obj) + b"\n\n"

        if chat:
            role = {
                "id": rid,
                "object": kind,
                "created": 1,
                "model": MODEL,
                "choices": [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            }
            await resp.write(b"data: " + orjson.dumps(role) + b"\n\n")
        done = 0
        first = True
        while done < n:
            await asyncio.sleep(0.005)
            k = min(self.per_event, n - done)
            if self.die_after is not None and done + k >= self.die_after:
                k = self.die_after - done
                new = [100 + len(ids) + done + i for i in range(k)]
                done += k
                await resp.write(event(new, done, "abort", first))
                await resp.write(b"data: [DONE]\n\n")
                return resp
            new = [100 + len(ids) + done + i for i in range(k)]
            done += k
            await resp.write(event(new, done, "length" if done == n else None, first))
            first = False
        if so.get("include_usage"):
            u = {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}
            final = {
                "id": rid,
                "object": kind,
                "created": 1,
                "model": MODEL,
                "choices": [],
                "usage": u,
            }
            await resp.write(b"data: " + orjson.dumps(final) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    def close(self) -> None:
        assert self._loop is not None and self._runner is not None
        fut = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop)
        fut.result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[Proc, FakeVllm, FakeVllm]]:
    a = FakeVllm(die_after=10)
    b = FakeVllm()
    cfg = tmp_path / "gw.json"
    cfg.write_text(json.dumps({"stall_timeout_s": 10.0}))
    g = gateway(tmp_path, f"primary={a.url}", f"fallback={b.url}", args=("--config", str(cfg)))
    yield g, a, b
    g.stop()
    a.close()
    b.close()


def _text(events: list[Any], chat: bool) -> str:
    return "".join(
        ((c.get("delta") or {}).get("content") or "") if chat else (c.get("text") or "")
        for e in events
        if isinstance(e, dict)
        for c in e.get("choices", [])
    )


@pytest.mark.parametrize("chat", [False, True])
def test_abort_is_a_break_and_the_continuation_is_token_exact(
    pair: tuple[Proc, FakeVllm, FakeVllm], chat: bool
) -> None:
    g, _a, b = pair
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 40,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
    events, r = stream(g.url, path, body)
    assert r.status_code == 200
    p = len(PROMPT_IDS[path])
    # Every token once, in order: 10 from a (4 events of up to 3), 30 from b.
    assert _text(events, chat) == "".join(tok(p + i) for i in range(40))
    objs = [e for e in events if isinstance(e, dict)]
    finishes = [c["finish_reason"] for e in objs for c in e["choices"] if c.get("finish_reason")]
    assert finishes == ["length"]  # the abort never reached the client
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert len({e["id"] for e in objs}) == 1
    # Usage: the client's prompt, all 40 tokens; only at the end, as asked.
    usage = [e["usage"] for e in objs if e.get("usage")]
    assert usage == [{"prompt_tokens": p, "completion_tokens": 40, "total_tokens": p + 40}]
    # No token ids: the client did not ask for them.
    assert not any(
        c.get("token_ids") or c.get("prompt_token_ids") for e in objs for c in e["choices"]
    )
    if chat:
        assert sum(1 for e in objs for c in e["choices"] if "role" in c.get("delta", {})) == 1
        assert all(e["object"] == "chat.completion.chunk" for e in objs)
    # b was asked to continue from the ids: prompt ids + the 10 generated, 30 left.
    cont = [bd for pth, bd in b.bodies if bd.get("stream")]
    assert len(cont) == 1
    assert cont[0]["prompt"] == PROMPT_IDS[path] + [100 + p + i for i in range(10)]
    assert cont[0]["max_tokens"] == 30
    assert "messages" not in cont[0]
    assert metric(g.url, "unbroken_gateway_streams_migrated_total", reason="abort") == 1
    assert metric(g.url, "unbroken_gateway_migration_path_total", path="tokens") == 1


def test_a_client_that_asks_for_token_ids_gets_them_all_once(
    pair: tuple[Proc, FakeVllm, FakeVllm],
) -> None:
    g, _a, _b = pair
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 25, "return_token_ids": True}
    events, _ = stream(g.url, "/v1/completions", body)
    objs = [e for e in events if isinstance(e, dict)]
    ids = [t for e in objs for c in e["choices"] for t in (c.get("token_ids") or [])]
    assert ids == [103 + i for i in range(25)]
    prompts = [
        c["prompt_token_ids"] for e in objs for c in e["choices"] if c.get("prompt_token_ids")
    ]
    assert prompts == [[1, 2, 3]]  # the continuation's own prompt ids are not passed on
    assert not any("usage" in e for e in objs)


def test_a_split_inside_a_character_is_moved_back(
    pair: tuple[Proc, FakeVllm, FakeVllm],
) -> None:
    """a dies right after a token whose text it still held back (an incomplete UTF-8
    sequence): that token is given back and regenerated by b, so its text is not lost."""
    g, a, b = pair
    for e in (a, b):
        e.partial = {112, 125}
    body = {
        "model": MODEL,
        "prompt": "hi",
        "max_tokens": 40,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    events, _ = stream(g.url, "/v1/completions", body)
    assert _text(events, False) == "".join(tok(3 + i) for i in range(40))
    usage = [e["usage"] for e in events if isinstance(e, dict) and e.get("usage")]
    assert usage == [{"prompt_tokens": 3, "completion_tokens": 40, "total_tokens": 43}]
    cont = [bd for _, bd in b.bodies if bd.get("stream")]
    assert cont[0]["prompt"] == [1, 2, 3] + [103 + i for i in range(9)]  # 112 given back
    assert cont[0]["max_tokens"] == 31


def test_only_an_engine_that_takes_the_plain_form_is_marked_as_refusing(tmp_path: Path) -> None:
    """The gateway asks for token ids and usage on every chunk (the augmented form) and
    falls back to the client's own body on a 4xx; an endpoint that refused the augmented
    form while taking the plain one is not asked for it again. A request the engine refuses
    in both forms (a bad `max_tokens`) says nothing about the form: it marked the endpoint
    for good, so that one bad request cost every later stream its exact continuation (a
    helper's review)."""
    e = FakeVllm()
    g = gateway(tmp_path, e.url)
    try:
        body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4}
        for _ in range(2):
            _, r = stream(g.url, "/v1/completions", {**body, "max_tokens": "five"})
            assert r.status_code == 400
        e.bodies.clear()
        events, r = stream(g.url, "/v1/completions", body)
        assert r.status_code == 200 and events[-1] == "[DONE]"
        assert e.bodies[0][1].get("return_token_ids") is True  # still augmented
        assert "refuses augmented" not in g.tail(200)
        # An engine that takes only the plain form: asked once, then not again.
        e.old = True
        for _ in range(2):
            e.bodies.clear()
            events, r = stream(g.url, "/v1/completions", body)
            assert r.status_code == 200 and events[-1] == "[DONE]"
        assert [b.get("return_token_ids") for _, b in e.bodies] == [None]
        assert "refuses augmented" in g.tail(200)
    finally:
        g.stop()
