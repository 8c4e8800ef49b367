"""Tenants (issue 25): API keys to tenants, 401 for unknown keys, per-tenant limits at their
exact boundary (one process and two workers), OpenAI's 429 and x-ratelimit headers through
the openai client, tokens counted as the engine reports them (a continued stream's once),
per-tenant metrics, and fair queueing within a priority (deterministic order)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from helpers import MODEL, Proc, engine, gateway, metric, ready_endpoint
from unbroken.config.tenants import key_digest
from unbroken.engine.textmodel import expected_completion
from unbroken.gateway._admission import Admission
from unbroken.gateway._pool import Pool

KEYS = {"acme": "sk-acme-secret", "beta": "sk-beta-secret", "gamma": "sk-gamma-secret"}


def tenants_config(path: Path, tenants: list[dict[str, Any]], **extra: Any) -> Path:
    """A gateway --config with these tenants (each `key` replaced by its digest)."""
    out = []
    for t in tenants:
        t = dict(t)
        key = t.pop("key", None)
        t["api_keys"] = [key_digest(key)] if key else []
        out.append(t)
    path.write_text(json.dumps({"tenants": out, **extra}))
    return path


def client(g: Proc, key: str | None, **kw: Any) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=g.url + "/v1", api_key=key or "none", max_retries=0, timeout=30, **kw
    )


def complete(g: Proc, key: str, max_tokens: int = 4, **kw: Any) -> httpx.Response:
    return httpx.post(
        g.url + "/v1/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": MODEL, "prompt": "hello there", "max_tokens": max_tokens, **kw},
        timeout=30,
    )


# -- fair queueing: the order, deterministically ------------------------------------------------
def test_fair_queue_takes_turns_by_weight() -> None:
    """One slot; tenant greedy queues 10, then light queues 1: light is served second, not
    eleventh. Weights 2:1 share turns 2:1. Critical still goes before standard, and the
    per-pool `waiting` count (the autoscaling demand) is balanced at the end."""

    async def run() -> None:
        pool = Pool(default_cap=1)
        ep = ready_endpoint("e")
        pool.add(ep)
        adm = Admission(pool, queue_timeout=5.0)
        first = await adm.acquire("m", "standard", tenant="greedy")
        order: list[str] = []

        async def one(tenant: str, priority: str = "standard", share: float = 1.0) -> None:
            e, n, _ = await adm.acquire("m", priority, tenant=tenant, share=share)
            order.append(tenant)
            await asyncio.sleep(0)
            adm.release(e, n)

        tasks = [asyncio.create_task(one("greedy")) for _ in range(10)]
        await asyncio.sleep(0.01)
        tasks.append(asyncio.create_task(one("light")))
        await asyncio.sleep(0.01)
        tasks.append(asyncio.create_task(one("boss", "critical")))
        await asyncio.sleep(0.01)
        assert adm.demand() == {"default": 1 + 12}
        adm.release(*first[:2])
        await asyncio.gather(*tasks)
        assert order[0] == "boss"  # priority order across classes holds
        assert order[1:3] == ["greedy", "light"], order  # light waits one turn, not ten
        assert order.count("greedy") == 10
        assert adm.waiting == {"default": 0} and adm.demand() == {}

        # Weights: a (2) and b (1), 30 waiters each: the first 12 served are 8 a and 4 b.
        first = await adm.acquire("m", "standard", tenant="x")
        order.clear()
        tasks = [asyncio.create_task(one("a", share=2.0)) for _ in range(30)]
        tasks += [asyncio.create_task(one("b", share=1.0)) for _ in range(30)]
        await asyncio.sleep(0.01)
        adm.release(*first[:2])
        await asyncio.gather(*tasks)
        assert order[:12].count("a") == 8 and order[:12].count("b") == 4, order[:12]
        assert adm.waiting == {"default": 0} and adm.demand() == {}

        # Without tenants: FIFO, as before.
        first = await adm.acquire("m", "standard")
        order.clear()
        got: list[int] = []

        async def plain(i: int) -> None:
            e, n, _ = await adm.acquire("m", "standard")
            got.append(i)
            await asyncio.sleep(0)
            adm.release(e, n)

        tasks = []
        for i in range(8):
            tasks.append(asyncio.create_task(plain(i)))
            await asyncio.sleep(0)
        await asyncio.sleep(0.01)
        adm.release(*first[:2])
        await asyncio.gather(*tasks)
        assert got == list(range(8))

    asyncio.run(run())


# -- real processes -------------------------------------------------------------------------------
@pytest.fixture
def eng(tmp_path: Path) -> Iterator[Proc]:
    e = engine(tmp_path)
    yield e
    e.stop()


def test_keys_priorities_and_401(tmp_path: Path, eng: Proc) -> None:
    cfg = tenants_config(
        tmp_path / "gw.json",
        [
            {"name": "acme", "key": KEYS["acme"], "priority": "sheddable"},
            {"name": "beta", "key": KEYS["beta"], "priority": "critical"},
        ],
    )
    g = gateway(tmp_path, eng.url, args=("--config", str(cfg)))
    try:
        # Unknown key and no key: 401 invalid_api_key, as OpenAI answers (openai client).
        for key in ("sk-wrong", None):
            with pytest.raises(openai.AuthenticationError) as ei:
                c = client(g, key) if key else client(g, None)
                if key is None:
                    c = openai.OpenAI(
                        base_url=g.url + "/v1",
                        api_key="x",
                        max_retries=0,
                        default_headers={"Authorization": ""},
                    )
                c.completions.create(model=MODEL, prompt="hi", max_tokens=2)
            assert ei.value.status_code == 401
            assert ei.value.code == "invalid_api_key"
            assert "sk-wrong" not in str(ei.value.body)
        ok = client(g, KEYS["acme"]).completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert ok.choices[0].text
        # /v1/models too, as vLLM with --api-key guards every /v1 route.
        r = httpx.get(g.url + "/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert client(g, KEYS["acme"]).models.list().data[0].id == MODEL
        # Engine routes the gateway passes through need a tenant's key too.
        tok = {"model": MODEL, "tokens": [1, 2]}
        r = httpx.post(g.url + "/detokenize", json=tok, headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        h = {"Authorization": f"Bearer {KEYS['acme']}"}
        assert httpx.post(g.url + "/detokenize", json=tok, headers=h).status_code == 200
        # A tenant's priority is a ceiling: the header lowers it, never raises it.
        h = {"Authorization": f"Bearer {KEYS['beta']}", "x-unbroken-priority": "sheddable"}
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        assert httpx.post(g.url + "/v1/completions", headers=h, json=body).status_code == 200
        h = {"Authorization": f"Bearer {KEYS['acme']}", "x-unbroken-priority": "critical"}
        assert httpx.post(g.url + "/v1/completions", headers=h, json=body).status_code == 200
        m = lambda **kw: metric(g.url, "unbroken_gateway_requests_total", **kw)  # noqa: E731
        assert m(priority="sheddable", status="200") == 4  # 3 completions, 1 /detokenize
        assert m(priority="critical", status="200") == 0
        assert metric(g.url, "unbroken_gateway_tenant_requests_total", tenant="acme") == 3
        assert metric(g.url, "unbroken_gateway_tenant_requests_total", tenant="beta") == 1
        assert (
            metric(
                g.url,
                "unbroken_gateway_tenant_rejections_total",
                tenant="none",
                reason="invalid_api_key",
            )
            == 4
        )
        # ... and answered, under tenant none (its HELP says so; none was counted).
        assert (
            metric(g.url, "unbroken_gateway_tenant_requests_total", tenant="none", status="401")
            == 4
        )
        # Keys never reach the metrics or the log.
        text = httpx.get(g.url + "/metrics").text
        assert all(k not in text for k in KEYS.values()) and "sk-wrong" not in text
        assert all(k not in g.tail(10_000) for k in KEYS.values())
    finally:
        g.stop()
    # With an `anonymous` tenant, unknown keys are its requests.
    cfg = tenants_config(
        tmp_path / "gw2.json",
        [{"name": "acme", "key": KEYS["acme"]}, {"name": "anonymous", "priority": "sheddable"}],
    )
    g = gateway(tmp_path, eng.url, args=("--config", str(cfg)))
    try:
        r = client(g, "sk-whoever").completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert r.choices[0].text
        assert client(g, "sk-whoever").models.list().data[0].id == MODEL
        assert metric(g.url, "unbroken_gateway_tenant_requests_total", tenant="anonymous") == 1
    finally:
        g.stop()


def _burst(g: Proc, key: str, n: int, max_tokens: int = 2) -> list[httpx.Response]:
    out: list[httpx.Response] = []
    lock = threading.Lock()

    def one() -> None:
        r = complete(g, key, max_tokens)
        with lock:
            out.append(r)

    ts = [threading.Thread(target=one) for _ in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out


@pytest.mark.parametrize("workers", [1, 2])
def test_requests_per_minute_exact_under_concurrency(
    tmp_path: Path, eng: Proc, workers: int
) -> None:
    """rpm 12: 40 concurrent requests, exactly 12 served (a bucket refills one request per
    5 s, and this takes well under that), the rest 429 with OpenAI's body and headers."""
    cfg = tenants_config(
        tmp_path / "gw.json",
        [
            {"name": "acme", "key": KEYS["acme"], "limits": {"requests_per_minute": 12}},
            {"name": "beta", "key": KEYS["beta"]},
        ],
    )
    g = gateway(tmp_path, eng.url, args=("--config", str(cfg), "--workers", str(workers)))
    try:
        t0 = time.monotonic()
        rs = _burst(g, KEYS["acme"], 40)
        took = time.monotonic() - t0
        ok = [r for r in rs if r.status_code == 200]
        refused = [r for r in rs if r.status_code == 429]
        assert took < 4.5, took
        assert len(ok) == 12 and len(refused) == 28
        err = refused[0].json()["error"]
        assert err["type"] == "requests" and err["code"] == "rate_limit_exceeded"
        h = refused[0].headers
        assert int(h["retry-after"]) >= 1 and int(h["retry-after-ms"]) > 0
        assert h["x-ratelimit-limit-requests"] == "12"
        assert h["x-ratelimit-remaining-requests"] == "0"
        assert h["x-ratelimit-reset-requests"].endswith("s")
        # Successful answers carry the headers too; remaining counts down.
        rem = sorted(int(r.headers["x-ratelimit-remaining-requests"]) for r in ok)
        assert rem == list(range(12)), rem
        # Another tenant is not affected.
        assert complete(g, KEYS["beta"]).status_code == 200
        # The openai client raises RateLimitError (and would back off on its own).
        with pytest.raises(openai.RateLimitError) as ei:
            client(g, KEYS["acme"]).completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert ei.value.body["type"] == "requests"  # type: ignore[index]
        time.sleep(1.0)
        assert (
            metric(
                g.url,
                "unbroken_gateway_tenant_rejections_total",
                tenant="acme",
                reason="requests_per_minute",
            )
            == 29
        )
        ok_n = metric(g.url, "unbroken_gateway_tenant_requests_total", tenant="acme", status="200")
        assert ok_n == 12
    finally:
        g.stop()


def test_concurrent_streams_exact_across_two_workers(tmp_path: Path) -> None:
    e = engine(tmp_path, "--decode-base-s", "0.02", fast=False)
    cfg = tenants_config(
        tmp_path / "gw.json",
        [{"name": "acme", "key": KEYS["acme"], "limits": {"concurrent_streams": 3}}],
    )
    # Spread over both workers (no packing under light load): the limit is held across them.
    g = gateway(
        tmp_path, e.url, args=("--config", str(cfg), "--workers", "2", "--accept-pack-cpu", "0")
    )
    try:
        # 8 long streams at once: exactly 3 run, 5 are refused at once.
        rs = _burst(g, KEYS["acme"], 8, max_tokens=60)
        codes = sorted(r.status_code for r in rs)
        assert codes == [200] * 3 + [429] * 5, codes
        bad = next(r for r in rs if r.status_code == 429)
        assert "concurrent streams" in bad.json()["error"]["message"]
        # Once they are over, the slots are back (in every worker).
        assert sorted(r.status_code for r in _burst(g, KEYS["acme"], 3)) == [200] * 3
    finally:
        g.stop()
        e.stop()


def test_token_limits_count_usage(tmp_path: Path, eng: Proc) -> None:
    """completion tpm 100: requests go through while the bucket has room, the answer that
    takes it past the limit is whole (never cut), and the next request is refused with
    type `tokens` until the bucket drains."""
    cfg = tenants_config(
        tmp_path / "gw.json",
        [
            {
                "name": "acme",
                "key": KEYS["acme"],
                "limits": {"completion_tokens_per_minute": 100, "prompt_tokens_per_minute": 1000},
            }
        ],
    )
    g = gateway(tmp_path, eng.url, args=("--config", str(cfg)))
    try:
        c = client(g, KEYS["acme"])
        r1 = c.completions.with_raw_response.create(model=MODEL, prompt="a b", max_tokens=60)
        assert r1.headers["x-ratelimit-limit-tokens"] in ("100", "1000")
        assert r1.parse().usage.completion_tokens == 60
        # The token headers net of this request's estimate, as OpenAI's: max_tokens 60 of
        # the completion bucket's 100, and its prompt of the prompt bucket's 1,000.
        assert r1.headers["x-ratelimit-remaining-completion-tokens"] == "40"
        assert 990 <= int(r1.headers["x-ratelimit-remaining-prompt-tokens"]) < 1000
        assert r1.headers["x-ratelimit-remaining-tokens"] == "40"  # the scarcer of the two
        # A stream: 60 more (120 in all, past the limit: the stream is whole).
        s = c.completions.create(
            model=MODEL, prompt="a b", max_tokens=60, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = list(s)
        assert chunks[-1].usage.completion_tokens == 60
        with pytest.raises(openai.RateLimitError) as ei:
            c.completions.create(model=MODEL, prompt="a b", max_tokens=5)
        assert ei.value.body["type"] == "tokens"  # type: ignore[index]
        retry = int(ei.value.response.headers["retry-after"])
        assert 10 <= retry <= 15, retry  # 21 tokens over at 100/min: ~12.6 s
        assert ei.value.response.headers["x-ratelimit-remaining-completion-tokens"] == "0"
        time.sleep(0.5)
        tok = lambda kind: metric(  # noqa: E731
            g.url, "unbroken_gateway_tenant_tokens_total", tenant="acme", kind=kind
        )
        assert tok("completion") == 120
        assert tok("prompt") == 4  # 2 words, twice
    finally:
        g.stop()


def test_continued_stream_counted_once(tmp_path: Path) -> None:
    """A stream broken after 25 tokens and continued on another engine: the tenant is
    charged the client's prompt once and the 80 tokens it received, not the continuation's
    prompt (prompt + the 25 generated) on top."""
    from unbroken.engine.textmodel import expected_completion

    a = engine(tmp_path, name="a")
    b = engine(tmp_path, name="b")
    cfg = tenants_config(
        tmp_path / "gw.json",
        [{"name": "acme", "key": KEYS["acme"], "limits": {"completion_tokens_per_minute": 1000}}],
        stall_timeout_s=1.0,
    )
    g = gateway(tmp_path, f"primary={a.url}", f"fallback={b.url}", args=("--config", str(cfg)))
    try:
        from helpers import TOKEN

        httpx.post(
            a.url + "/admin/faults",
            headers={"Authorization": f"Bearer {TOKEN}"},
            json={"kind": "fail", "fraction": 1.0, "after_tokens": 25},
        )
        c = client(g, KEYS["acme"])
        s = c.completions.create(
            model=MODEL, prompt="errors happen", max_tokens=80, stream=True, temperature=0,
            stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = list(s)
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        assert text == expected_completion("errors happen", 80).text
        assert chunks[-1].usage.completion_tokens == 80
        prompt = chunks[-1].usage.prompt_tokens
        assert metric(g.url, "unbroken_gateway_streams_migrated_total", reason="error_event") == 1
        tok = lambda kind: metric(  # noqa: E731
            g.url, "unbroken_gateway_tenant_tokens_total", tenant="acme", kind=kind
        )
        assert tok("completion") == 80
        assert tok("prompt") == prompt
    finally:
        for p in (g, a, b):
            p.stop()


def test_a_stream_handed_over_at_a_reload_keeps_its_tenant_count(tmp_path: Path) -> None:
    """concurrent_streams 1: a tenant's one stream is handed to a new worker by a reload
    (SIGHUP); the new worker counts it, so a second stream of the tenant is still refused
    while it runs, and its completion tokens are charged once in all."""
    import signal

    from helpers import admin, wait_for
    from test_gateway_handover import read_stream as read_sse

    e = engine(tmp_path, "--decode-base-s", "0.01")
    cfg = tenants_config(
        tmp_path / "gw.json",
        [{"name": "acme", "key": KEYS["acme"], "limits": {"concurrent_streams": 1}}],
    )
    g = gateway(tmp_path, e.url, args=("--config", str(cfg), "--workers", "2"))
    # ~10 s at 10 ms a token: the reload (new workers started, on a loaded machine in up to
    # ~5 s) happens in its middle (400 tokens ended before it once, in a busy run).
    n = 1000
    out: dict[str, Any] = {}
    flowing = threading.Event()
    try:
        c = httpx.Client(timeout=60, headers={"Authorization": f"Bearer {KEYS['acme']}"})
        t = threading.Thread(
            target=lambda: out.update(r=read_sse(c, g.url, "handed over", n, flowing=flowing.set))
        )
        t.start()
        assert flowing.wait(20)
        gen = admin(g, "GET", "/admin/status").json()["workers"]["generation"]
        g.signal(signal.SIGHUP)
        wait_for(
            lambda: admin(g, "GET", "/admin/status").json()["workers"]["generation"] > gen,
            timeout=30,
            what="reload",
        )
        wait_for(lambda: metric(g.url, "unbroken_gateway_streams_handed_over_total",
                                direction="in") >= 1, timeout=20, what="handed over")  # fmt: skip
        assert t.is_alive(), "the stream ended before it was handed over"
        r = complete(g, KEYS["acme"], max_tokens=2)
        assert r.status_code == 429, r.text
        assert r.json()["error"]["type"] == "requests" or "concurrent" in r.text
        t.join(60)
        text, usage = out["r"]
        assert usage["completion_tokens"] == n
        assert text == expected_completion("handed over", n).text
        wait_for(lambda: complete(g, KEYS["acme"], max_tokens=2).status_code == 200,
                 timeout=10, what="the count back to 0")  # fmt: skip
        charged = metric(g.url, "unbroken_gateway_tenant_tokens_total", tenant="acme",
                         kind="completion")  # fmt: skip
        assert charged == n + 2, charged  # the stream's tokens once, and the request after
    finally:
        g.stop()
        e.stop()
