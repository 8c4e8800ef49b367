"""Hung engines and non-streaming requests; `/v1/models` while nothing serves (issue 21,
findings 1 and 9). Real engines and gateways; one test adds a small aiohttp stand-in in this
process that hangs real requests on purpose (`HangsReal`)."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
from aiohttp import web

from helpers import MODEL, Proc, admin, engine, gateway, metric, wait_endpoints, wait_for
from unbroken.engine.textmodel import expected_completion
from unbroken.wire.http import free_port


def _config(tmp: Path, **settings: Any) -> tuple[str, str]:
    path = tmp / f"gw-{len(list(tmp.glob('gw-*.json')))}.json"
    path.write_text(json.dumps(settings))
    return ("--config", str(path))


class HangsReal:
    """Stands in for an engine that passes every check the gateway makes of it (/health,
    /v1/models, the small warm-up completion) and hangs every real request: a wedged kernel
    path only real prompts take, a deadlocked scheduler that still answers its HTTP routes.
    It counts the real requests it receives."""

    def __init__(self) -> None:
        self.port = free_port()
        self.real = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def name(self) -> str:
        return f"127.0.0.1:{self.port}"

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

    async def _complete(self, request: web.Request) -> web.Response:
        obj = await request.json()
        if obj.get("prompt") != "warm up":
            self.real += 1
            await asyncio.sleep(3600)
        choice = {"index": 0, "text": "ok", "finish_reason": "length", "logprobs": None}
        usage = {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}
        return web.json_response(
            {"id": "c1", "object": "text_completion", "created": 1, "model": MODEL,
             "choices": [choice], "usage": usage}
        )  # fmt: skip

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


def _complete(g: Proc, prompt: str, timeout: float = 20.0) -> tuple[httpx.Response, float]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    t0 = time.monotonic()
    r = httpx.post(g.url + "/v1/completions", json=body, timeout=timeout)
    return r, time.monotonic() - t0


def _healthy(g: Proc, name: str) -> bool:
    eps = {e["name"]: e for e in admin(g, "GET", "/admin/endpoints").json()["endpoints"]}
    return bool(eps[name]["healthy"])


def test_sigstopped_engine_does_not_hold_nonstreaming_requests(tmp_path: Path) -> None:
    """One of two engines SIGSTOPped: the first non-streaming completion that landed on it
    waited the whole request timeout (600 s), the client gave up. Now each request has the
    endpoint's learned answer limit: a `max_tokens: 4` answer from an engine whose warm-up
    took milliseconds may take the floor, `ttfb_min_s` (5 s, the default kept here), and is
    then tried on the other engine. Bound: 10 s per request, the floor plus its retry with
    room for a loaded machine; the client gives up at 20 s (the old code's hang)."""
    a = engine(tmp_path, name="a")
    b = engine(tmp_path, name="b")
    g = gateway(tmp_path, a.url, b.url)
    try:
        a.signal(signal.SIGSTOP)
        took = []
        for i in range(6):
            prompt = f"stopped {i}"
            try:
                r, t = _complete(g, prompt)
            except httpx.TimeoutException:
                raise AssertionError(f"request {i} got no answer in 20 s") from None
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == expected_completion(prompt, 4).text
            assert r.headers["X-Unbroken-Endpoint"] == f"127.0.0.1:{b.port}"
            took.append(t)
        assert all(t < 10 for t in took), took
        # The stopped engine was caught by the answer limit (not only by its /health).
        assert metric(g.url, "unbroken_gateway_retries_total", reason="answer") >= 1
        assert sorted(took)[-2] < 2, took  # one request paid the limit, not the others
    finally:
        a.signal(signal.SIGCONT)
        for p in (g, a, b):
            p.stop()


def test_a_long_answer_on_an_idle_engine_is_not_taken_for_a_hang(tmp_path: Path) -> None:
    """A non-streaming request without `max_tokens` on an engine that answered only short
    ones: its answer limit assumes 256 tokens, so ~1,400 tokens outran it. The engine was
    busy with this very request (its `vllm:generation_tokens_total` rising at every scrape)
    but showed the gateway nothing, so the answer was thrown away, generated again on the
    other engine, and the first taken out of rotation as hung (a review, 2026-12-07). Now
    the engine's rising count is a sign of life: the answer comes from where it started,
    with no retry, and both engines stay in rotation."""
    args = ("--max-model-len", "1400")  # a chat without max_tokens runs to the model's length
    engs = [engine(tmp_path, *args, name=f"e{i}") for i in range(2)]
    g: Proc | None = None
    try:
        g = gateway(tmp_path, *(e.url for e in engs), args=_config(tmp_path, ttfb_min_s=0.5))
        for i in range(4):  # short answers: the limit's samples (~ms each)
            r, _ = _complete(g, f"short {i}")
            assert r.status_code == 200, r.text
        t0 = time.monotonic()
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "long"}]}
        r = httpx.post(g.url + "/v1/chat/completions", json=chat, timeout=120)
        took = time.monotonic() - t0
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] > 1000, r.json()["usage"]
        try:
            retries = metric(g.url, "unbroken_gateway_retries_total")
        except KeyError:
            retries = 0.0  # no retry of any reason: no series yet
        eps = admin(g, "GET", "/admin/endpoints").json()["endpoints"]
        assert retries == 0 and all(e["healthy"] for e in eps), (retries, took, eps)
    finally:
        for p in (g, *engs):
            if p is not None:
                p.stop()


def test_engine_hanging_real_requests_is_routed_around_and_held_out(tmp_path: Path) -> None:
    """An engine that answers /health, /v1/models and the warm-up but hangs real requests,
    beside a real one: 10 of 10 parallel non-streaming requests hung until the client gave
    up, and the endpoint was back in rotation one probe (0.6 s) after it was caught, because
    its warm-up passes. Now every request is answered by the other replica promptly (its
    limit here `ttfb_min_s` = 1 s, the stand-in's warm-up being instant; bound 6 s with the
    retry), and the endpoint stays out for a hold that doubles each time it is caught again
    (2 s, then 4 s): its passing warm-up alone does not bring it back."""
    fake = HangsReal()
    real = engine(tmp_path, name="real")
    g = gateway(tmp_path, fake.url, real.url, args=_config(tmp_path, ttfb_min_s=1.0))
    try:
        with ThreadPoolExecutor(10) as ex:
            results = list(ex.map(lambda i: _complete(g, f"wave {i}", timeout=15), range(10)))
        took = [t for _, t in results]
        assert all(r.status_code == 200 for r, _ in results), [r.text for r, _ in results]
        for i, (r, _) in enumerate(results):
            assert r.json()["choices"][0]["text"] == expected_completion(f"wave {i}", 4).text
        assert max(took) < 6, took
        assert fake.real >= 1  # some were sent to it first
        caught_at = time.monotonic()
        assert not _healthy(g, fake.name)
        # Its warm-up passes at every probe (1 s), yet it stays out: no real traffic.
        seen = fake.real
        while time.monotonic() - caught_at < 1.5:
            assert not _healthy(g, fake.name)
            r, t = _complete(g, "meanwhile")
            assert r.status_code == 200 and t < 1, t
        assert fake.real == seen
        # It comes back after its hold, is caught by the next real request (retried on the
        # other engine), and is held out twice as long.
        wait_for(lambda: _healthy(g, fake.name), timeout=10, what="the hold to end")
        n = 0
        while fake.real == seen:
            r, t = _complete(g, f"again {n}")
            assert r.status_code == 200 and t < 6, t
            n += 1
            assert n < 20, "the fake got no request after it came back"
        wait_for(lambda: not _healthy(g, fake.name), timeout=5, what="caught again")
        again = time.monotonic()
        while time.monotonic() - again < 3.0:
            assert not _healthy(g, fake.name), "back before its doubled hold"
            time.sleep(0.1)
    finally:
        g.stop()
        real.stop()
        fake.close()


def test_models_is_503_until_something_serves(tmp_path: Path) -> None:
    """While the engines start, /v1/models answered 200 with an empty list: a script that
    waits for a 200 and takes data[0] failed. Now it is a 503 with Retry-After in OpenAI's
    error format (the openai client retries it), and the list once an engine is ready."""
    nothing = f"http://127.0.0.1:{free_port()}"  # an engine not up yet: connection refused
    g = gateway(tmp_path, nothing, wait_ready=0)
    try:
        r = httpx.get(g.url + "/v1/models", timeout=10)
        assert r.status_code == 503, r.text
        assert r.headers["Retry-After"] == "1"
        err = r.json()["error"]
        assert err["code"] == "no_endpoint" and err["message"] and "type" in err
        # The openai client takes it as retryable: it keeps asking, then gives up with the
        # 503 (not an empty list).
        client = openai.OpenAI(base_url=g.url + "/v1", api_key="x", max_retries=1, timeout=10)
        t0 = time.monotonic()
        try:
            client.models.list()
            raise AssertionError("an empty model list was returned")
        except openai.APIStatusError as e:
            assert e.status_code == 503
        assert time.monotonic() - t0 >= 0.9  # it waited Retry-After once
        e = engine(tmp_path, name="late")
        try:
            admin(g, "POST", "/admin/endpoints", {"url": e.url, "name": "late"})
            wait_endpoints(g, lambda eps: any(x["state"] == "ready" for x in eps))
            r = httpx.get(g.url + "/v1/models", timeout=10)
            assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL
            assert [m.id for m in client.models.list()] == [MODEL]
        finally:
            e.stop()
    finally:
        g.stop()
