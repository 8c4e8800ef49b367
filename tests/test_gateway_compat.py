"""The gateway is as permissive as its engine and hides its own plumbing (with the simulator;
the same against real vLLM is in tests/vllm/): requests the gateway does not need to judge
reach the engine, whose answer (status and body) reaches the client; the usage and token-id
options the gateway asks upstream never reach a client that did not ask for them; engine
routes pass through; /v1/models keeps the engine's fields."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers import MODEL, Proc, admin, engine, gateway, metric, stream, wait_endpoints, wait_for


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Proc]]:
    tmp = tmp_path_factory.mktemp("compat")
    e = engine(tmp)
    g = gateway(tmp, e.url)
    yield g, e
    g.stop()
    e.stop()


def _same(g: Proc, e: Proc, path: str, body: Any) -> httpx.Response:
    via = httpx.post(g.url + path, json=body, timeout=30)
    direct = httpx.post(e.url + path, json=body, timeout=30)
    assert via.status_code == direct.status_code, (body, via.text, direct.text)
    if direct.status_code >= 400:
        assert via.json() == direct.json()
    return via


def test_the_engine_judges_what_the_gateway_does_not_need(gw: tuple[Proc, Proc]) -> None:
    g, e = gw
    _same(g, e, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "5"})
    _same(g, e, "/v1/completions", {"model": MODEL, "prompt": "hi", "top_k": "5"})
    _same(
        g,
        e,
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "narrator", "content": "x"}], "max_tokens": 3},
    )
    ok = _same(g, e, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3})
    assert ok.status_code == 200
    # A stream's options the gateway adds to (usage on every chunk, token ids) stay the
    # engine's to judge: they got 200 when the gateway overwrote them (a helper's review).
    streamed = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": True}
    for bad in ("x", {"include_usage": "x"}, {"continuous_usage_stats": [1]}):
        r = _same(g, e, "/v1/completions", {**streamed, "stream_options": bad})
        assert r.status_code == 400, bad
    _same(g, e, "/v1/completions", {**streamed, "return_token_ids": "x"})
    # What the gateway needs is still its own to refuse.
    assert httpx.post(g.url + "/v1/completions", content=b"[1]", timeout=10).status_code == 400
    r = httpx.post(g.url + "/v1/completions", json={"model": 5, "prompt": "x"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    # An empty model is a missing one, as vLLM serves it (the gateway answered 400).
    for path, req in (
        ("/v1/completions", {"model": "", "prompt": "hi", "max_tokens": 2}),
        (
            "/v1/chat/completions",
            {"model": "", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
        ),
    ):
        assert _same(g, e, path, req).status_code == 200


def test_an_echo_stream_asks_no_token_ids() -> None:
    """With `echo`, vLLM 0.32 sends the echoed prompt's text empty when token ids are asked
    for (they carry the prompt instead): the gateway asked for them on every stream, and an
    echoing client lost its prompt (tests/vllm/test_vllm_gateway.py shows it on vLLM)."""
    from unbroken.gateway._continuation import augment

    plain = augment({"prompt": "hi", "stream": True})
    assert plain["return_token_ids"] is True and plain["stream_options"]["include_usage"]
    echo = augment({"prompt": "hi", "stream": True, "echo": True})
    assert "return_token_ids" not in echo and echo["stream_options"]["continuous_usage_stats"]
    # A client's own ask stays its own.
    mine = augment({"prompt": "hi", "echo": True, "return_token_ids": True})
    assert mine["return_token_ids"] is True


def _usage_chunks(events: list[Any]) -> list[dict[str, Any]]:
    return [e for e in events if isinstance(e, dict) and e.get("usage")]


@pytest.mark.parametrize("chat", [False, True])
def test_usage_reaches_the_client_only_as_asked(gw: tuple[Proc, Proc], chat: bool) -> None:
    g, _ = gw
    path = "/v1/chat/completions" if chat else "/v1/completions"
    base: dict[str, Any] = {"model": MODEL, "max_tokens": 20, "temperature": 0}
    if chat:
        base["messages"] = [{"role": "user", "content": "hello there"}]
    else:
        base["prompt"] = "hello there"
    plain, r = stream(g.url, path, base)
    assert r.status_code == 200 and plain[-1] == "[DONE]"
    assert not _usage_chunks(plain)
    assert not any("usage" in e for e in plain if isinstance(e, dict))
    final, _ = stream(g.url, path, {**base, "stream_options": {"include_usage": True}})
    u = _usage_chunks(final)
    assert len(u) == 1 and u[0]["choices"] == [] and u[0]["usage"]["completion_tokens"] == 20
    every, _ = stream(
        g.url,
        path,
        {**base, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    )
    counts = [e["usage"]["completion_tokens"] for e in _usage_chunks(every)]
    assert len(counts) > 20 and counts == sorted(counts) and counts[-1] == 20
    # continuous_usage_stats alone: no usage at all, as from the engine (vLLM's rule).
    alone, _ = stream(g.url, path, {**base, "stream_options": {"continuous_usage_stats": True}})
    assert not any("usage" in e for e in alone if isinstance(e, dict))


def test_a_client_that_leaves_mid_stream_counts_in_its_pool(gw: tuple[Proc, Proc]) -> None:
    """499 (the client left) under the pool its stream ran on; it was counted under `none`
    (the pool was known only once the relay returned, which a cancelled request never
    does)."""
    g, _ = gw

    def left(pool: str) -> float:
        try:
            return metric(g.url, "unbroken_gateway_requests_total", status="499", pool=pool)
        except KeyError:  # no such series yet
            return 0.0

    before = left("default")
    body = {"model": MODEL, "prompt": "leave", "max_tokens": 3000, "stream": True}
    with httpx.stream("POST", g.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert (
            r.headers["content-type"] == "text/event-stream; charset=utf-8"
        )  # as vLLM        next(r.iter_raw())  # the stream runs: then the client goes

    wait_for(lambda: left("default") == before + 1, timeout=10, what="499 in pool default")
    assert left("none") == 0


def test_models_keep_the_engines_fields(gw: tuple[Proc, Proc]) -> None:
    g, e = gw
    direct = httpx.get(e.url + "/v1/models", timeout=10).json()["data"]
    via = httpx.get(g.url + "/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in via] == [MODEL]
    assert via[0] == direct[0]  # max_model_len, root, owned_by: the engine's own


def test_engine_routes_pass_through(gw: tuple[Proc, Proc]) -> None:
    g, e = gw
    before = metric(g.url, "unbroken_gateway_requests_total", status="200")
    r = httpx.get(g.url + "/version", timeout=10)
    assert r.status_code == 200 and r.json() == httpx.get(e.url + "/version", timeout=10).json()
    assert metric(g.url, "unbroken_gateway_requests_total", status="200") == before + 1
    # A route the engine does not have: the engine's own 404 comes back.
    body = {"model": MODEL, "input": "x"}
    r = httpx.post(g.url + "/pooling", json=body, timeout=10)
    assert r.status_code == httpx.post(e.url + "/pooling", json=body, timeout=10).status_code == 404
    # One it has, as it answers it.
    r = httpx.post(g.url + "/tokenize", json={"model": MODEL, "prompt": "a b c"}, timeout=10)
    assert r.status_code == 200 and r.json()["count"] == 3
    # An unknown model is the gateway's to refuse.
    r = httpx.post(g.url + "/v1/embeddings", json={"model": "nope", "input": "x"}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    # A path neither serves is still the gateway's unknown route.
    assert httpx.get(g.url + "/v1/v1/models", timeout=10).status_code == 404


def test_a_run_of_5xx_takes_an_endpoint_out_until_readiness(tmp_path: Path) -> None:
    """/health stays green while every request gets a 500 (as vLLM shutting down): out of
    rotation after 3 in a row, back only once a real completion succeeds again."""
    a = engine(tmp_path, name="a")
    b = engine(tmp_path, name="b")
    g = gateway(tmp_path, f"primary={a.url}", f"fallback={b.url}")
    auth = {"Authorization": "Bearer test-admin-token"}
    name = f"127.0.0.1:{a.port}"
    try:
        httpx.post(a.url + "/admin/faults", json={"kind": "fail", "fraction": 1.0}, headers=auth)
        for i in range(3):
            r = httpx.post(
                g.url + "/v1/completions",
                json={"model": MODEL, "prompt": f"p{i}", "max_tokens": 2},
                timeout=30,
            )
            assert r.status_code == 200 and r.headers["x-unbroken-endpoint"] != name
        eps = admin(g, "GET", "/admin/endpoints").json()["endpoints"]
        assert not next(e for e in eps if e["name"] == name)["healthy"]
        time.sleep(2.5)  # /health is 200 all along: that alone does not bring it back
        eps = admin(g, "GET", "/admin/endpoints").json()["endpoints"]
        assert not next(e for e in eps if e["name"] == name)["healthy"]
        httpx.delete(a.url + "/admin/faults", headers=auth)
        wait_endpoints(g, lambda eps: next(e for e in eps if e["name"] == name)["healthy"])
        r = httpx.post(
            g.url + "/v1/completions", json={"model": MODEL, "prompt": "z", "max_tokens": 2}
        )
        assert r.headers["x-unbroken-endpoint"] == name
    finally:
        for p in (g, a, b):
            p.stop()


def test_cors_as_vllm(gw: tuple[Proc, Proc], tmp_path: Path) -> None:
    """vLLM 0.32's CORS (`--allowed-origins`, default []: "cross-origin browser access is
    disabled by default"): a browser's preflight is answered 400 and no answer is marked
    for another origin, by the simulator and the gateway alike (the gateway's default was
    every origin: it opened browser access to an unauthenticated API that vLLM refuses).
    Origins allowed (every one, or those named): preflights answered on every path, answers
    marked, streams included."""
    g, e = gw
    pre = {
        "Origin": "http://app.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    body = {"model": MODEL, "prompt": "cors", "max_tokens": 3, "stream": True}
    for url in (e.url, g.url):
        r = httpx.options(url + "/v1/chat/completions", headers=pre, timeout=10)
        assert r.status_code == 400 and r.text == "Disallowed CORS origin", (url, r.text)
        assert "access-control-allow-origin" not in r.headers
        events, r = stream(url, "/v1/completions", body, headers={"Origin": "http://app.example"})
        assert "access-control-allow-origin" not in r.headers and events[-1] == "[DONE]"
    # Every origin, as vLLM's `--allowed-origins '["*"]'`.
    e2 = engine(tmp_path, "--allowed-origins", '["*"]', name="cors-any")
    cfg = tmp_path / "any.yaml"
    cfg.write_text("cors_allowed_origins: ['*']\n")
    g1 = gateway(tmp_path, e.url, args=("--config", str(cfg)))
    try:
        for url in (e2.url, g1.url):
            r = httpx.options(url + "/v1/chat/completions", headers=pre, timeout=10)
            assert r.status_code == 200, (url, r.text)
            assert r.headers["access-control-allow-origin"] == "*"
            assert "POST" in r.headers["access-control-allow-methods"]
            assert r.headers["access-control-allow-headers"] == "authorization,content-type"
            events, r = stream(
                url, "/v1/completions", body, headers={"Origin": "http://app.example"}
            )
            assert r.headers["access-control-allow-origin"] == "*" and events[-1] == "[DONE]"
            r = httpx.post(url + "/v1/completions", json={**body, "stream": False}, timeout=10)
            assert "access-control-allow-origin" not in r.headers  # no Origin, no CORS
    finally:
        g1.stop()
        e2.stop()
    # Origins named in the settings: only those.
    cfg = tmp_path / "gw.yaml"
    cfg.write_text("cors_allowed_origins: ['http://good.example']\n")
    g2 = gateway(tmp_path, e.url, args=("--config", str(cfg)))
    try:
        ok = httpx.options(
            g2.url + "/v1/completions", headers={**pre, "Origin": "http://good.example"}
        )
        assert ok.status_code == 200
        assert ok.headers["access-control-allow-origin"] == "http://good.example"
        assert ok.headers["vary"] == "Origin"
        bad = httpx.options(
            g2.url + "/v1/completions", headers={**pre, "Origin": "http://evil.example"}
        )
        assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers
        body = {"model": MODEL, "prompt": "cors", "max_tokens": 3}
        r = httpx.post(
            g2.url + "/v1/completions", json=body, headers={"Origin": "http://evil.example"}
        )
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    finally:
        g2.stop()


def _fingerprints(events: list[Any]) -> list[tuple[bool, bool, str | None]]:
    """Per chunk: (finishing, usage chunk, its system_fingerprint)."""
    return [
        (
            any(c.get("finish_reason") for c in e["choices"]),
            not e["choices"],
            e.get("system_fingerprint"),
        )
        for e in events
        if isinstance(e, dict)
    ]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("usage", [False, True])
def test_system_fingerprint_is_where_the_engine_puts_it(
    gw: tuple[Proc, Proc], chat: bool, usage: bool
) -> None:
    """As vLLM: on the finishing chunk of a stream without `include_usage`, on the usage chunk
    with it, in a whole answer. The gateway asks the engine for usage on every stream, which
    moves the engine's fingerprint to the usage chunk the gateway strips for a client who did
    not ask: it puts the engine's (learned at warm-up) back on the finishing chunk."""
    g, e = gw
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 8, "temperature": 0}
    body.update(
        {"messages": [{"role": "user", "content": "fingerprint"}]}
        if chat
        else {"prompt": "fingerprint"}
    )
    whole = httpx.post(e.url + path, json=body, timeout=30).json()["system_fingerprint"]
    if usage:
        body["stream_options"] = {"include_usage": True}
    assert isinstance(whole, str) and whole
    direct, _ = stream(e.url, path, body)
    via, _ = stream(g.url, path, body)
    assert _fingerprints(via) == _fingerprints(direct)
    marked = [fp for _, _, fp in _fingerprints(via) if fp is not None]
    assert marked == [whole]  # one chunk carries it: the finishing one, or the usage chunk
    last = next(x for x in _fingerprints(via) if x[2] is not None)
    assert last[1] if usage else last[0]
    # Through the official client too (what users read it with).
    from openai import OpenAI

    c = OpenAI(base_url=g.url + "/v1", api_key="x")
    kw = {k: v for k, v in body.items() if k not in ("model", "stream_options")}
    extra = {"stream_options": {"include_usage": True}} if usage else {}
    if chat:
        chunks = list(c.chat.completions.create(model=MODEL, stream=True, **kw, **extra))
    else:
        chunks = list(c.completions.create(model=MODEL, stream=True, **kw, **extra))
    assert [ch.system_fingerprint for ch in chunks if ch.system_fingerprint] == [whole]
