"""The gateway over real sockets, in front of real engine processes."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import orjson
import pytest

from helpers import (
    MODEL,
    Proc,
    admin,
    engine,
    gateway,
    metric,
    ready_endpoint,
    stream,
    stream_text,
    wait_endpoints,
    wait_for,
)
from unbroken.engine.textmodel import expected_chat, expected_completion


def _raw_stream(
    url_port: int,
    body: dict,
    path: str = "/v1/completions",
    rcvbuf: int | None = None,
    headers: dict[str, str] | None = None,
    wait: bool = True,
) -> socket.socket:
    payload = orjson.dumps({**body, "stream": True})
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(("127.0.0.1", url_port))
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items()).encode()
    s.sendall(
        b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
        b"\r\n" + extra + b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload
    )
    if wait:
        s.recv(512)
    return s


def test_streams_and_non_streams_exactly(shared_gateway: tuple[Proc, Proc, Proc]) -> None:
    g, _a, _b = shared_gateway
    body = {
        "model": MODEL,
        "prompt": "Gateways relay",
        "max_tokens": 30,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    events, r = stream(g.url, "/v1/completions", body)
    assert r.status_code == 200 and r.headers["x-unbroken-endpoint"]
    assert stream_text(events, chat=False) == expected_completion("Gateways relay", 30).text
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 30
    msgs = [{"role": "user", "content": "hi"}]
    events, _ = stream(
        g.url,
        "/v1/chat/completions",
        {"model": MODEL, "messages": msgs, "max_tokens": 9, "temperature": 0},
    )
    assert stream_text(events, chat=True) == expected_chat(msgs, 9).text
    r2 = httpx.post(
        g.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": msgs, "max_tokens": 9, "temperature": 0},
    )
    assert r2.json()["choices"][0]["message"]["content"] == expected_chat(msgs, 9).text
    models = httpx.get(g.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]


def test_official_openai_client(shared_gateway: tuple[Proc, Proc, Proc]) -> None:
    from openai import OpenAI

    g = shared_gateway[0]
    client = OpenAI(base_url=g.url + "/v1", api_key="unused")
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="abc", max_tokens=8, temperature=0, stream=True
        )
    )
    assert (
        "".join(c.choices[0].text for c in chunks if c.choices)
        == expected_completion("abc", 8).text
    )
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=5, temperature=0, messages=[{"role": "user", "content": "yo"}]
    )
    assert chat.choices[0].message.content == expected_chat([("user", "yo")], 5).text


def test_least_loaded_endpoint_gets_the_request(shared_gateway: tuple[Proc, Proc, Proc]) -> None:
    g, _a, _b = shared_gateway
    socks = [
        _raw_stream(g.port, {"model": MODEL, "prompt": "x", "max_tokens": 3000}) for _ in range(6)
    ]
    try:
        eps = wait_endpoints(g, lambda eps: sum(e["inflight"] for e in eps) == 6)
        assert sorted(e["inflight"] for e in eps) == [3, 3]
    finally:
        for s in socks:
            s.close()
    wait_endpoints(g, lambda eps: sum(e["inflight"] for e in eps) == 0)


def test_client_disconnect_cancels_upstream(shared_gateway: tuple[Proc, Proc, Proc]) -> None:
    g, a, b = shared_gateway
    s = _raw_stream(g.port, {"model": MODEL, "prompt": "x", "max_tokens": 5000})
    wait_for(
        lambda: (
            metric(a.url, "vllm:num_requests_running") + metric(b.url, "vllm:num_requests_running")
            == 1
        )
    )
    s.close()
    t0 = time.monotonic()
    wait_for(
        lambda: (
            metric(a.url, "vllm:num_requests_running") + metric(b.url, "vllm:num_requests_running")
            == 0
        ),
        timeout=1.0,
    )
    assert time.monotonic() - t0 < 1.0
    assert metric(g.url, "unbroken_gateway_client_disconnects_total") >= 1


def test_retry_before_first_byte_on_connect_error_and_5xx(tmp_path: Path) -> None:
    a = engine(tmp_path, name="a")
    b = engine(tmp_path, name="b")
    cfg = tmp_path / "gw.yaml"
    cfg.write_text("probe_interval_s: 30\n")  # the dead endpoint stays listed as ready
    g = gateway(tmp_path, a.url, b.url, args=("--config", str(cfg)))
    try:
        b.signal(signal.SIGKILL)
        b.popen.wait(5)  # type: ignore[union-attr]
        for i in range(4):
            r = httpx.post(
                g.url + "/v1/completions", json={"model": MODEL, "prompt": f"p{i}", "max_tokens": 3}
            )
            assert r.status_code == 200 and r.headers["x-unbroken-endpoint"].endswith(str(a.port))
        assert metric(g.url, "unbroken_gateway_retries_total", reason="connect") == 1
        assert metric(g.url, "unbroken_gateway_upstream_errors_total", kind="connect") == 1
        events, r = stream(
            g.url,
            "/v1/completions",
            {"model": MODEL, "prompt": "s", "max_tokens": 4, "temperature": 0},
        )
        assert stream_text(events, chat=False) == expected_completion("s", 4).text
        # Every endpoint answers 500: the client gets the engine's OpenAI error, not a hang.
        httpx.post(
            a.url + "/admin/faults",
            json={"kind": "fail", "fraction": 1.0},
            headers={"Authorization": "Bearer test-admin-token"},
        )
        r = httpx.post(g.url + "/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert r.status_code == 500 and r.json()["error"]["code"] == "injected_fault"
        assert metric(g.url, "unbroken_gateway_retries_total", reason="status_500") == 1
    finally:
        for p in (g, a, b):
            p.stop()


def test_5xx_retried_on_a_healthy_endpoint(shared_gateway: tuple[Proc, Proc, Proc]) -> None:
    g, _a, b = shared_gateway
    auth = {"Authorization": "Bearer test-admin-token"}
    httpx.post(b.url + "/admin/faults", json={"kind": "fail", "fraction": 1.0}, headers=auth)
    try:
        for i in range(4):
            events, r = stream(
                g.url,
                "/v1/completions",
                {"model": MODEL, "prompt": f"q{i}", "max_tokens": 3, "temperature": 0},
            )
            assert r.status_code == 200 and events[-1] == "[DONE]"
        assert metric(g.url, "unbroken_gateway_retries_total", reason="status_500") >= 1
    finally:
        httpx.delete(b.url + "/admin/faults", headers=auth)


def test_drain_keeps_inflight_and_sends_new_elsewhere(tmp_path: Path) -> None:
    a = engine(tmp_path, name="a")
    b = engine(tmp_path, name="b")
    g = gateway(tmp_path, a.url, b.url)
    try:
        name_b = f"127.0.0.1:{b.port}"
        out: dict = {}
        body = {"model": MODEL, "prompt": "drain me", "max_tokens": 300, "temperature": 0}
        # Load a so that b is the least loaded, and start the long stream there.
        hold = _raw_stream(g.port, {"model": MODEL, "prompt": "x", "max_tokens": 5000})
        wait_endpoints(g, lambda eps: sum(e["inflight"] for e in eps) == 1)
        t = threading.Thread(target=lambda: out.update(r=stream(g.url, "/v1/completions", body)))
        t.start()
        wait_endpoints(g, lambda eps: all(e["inflight"] == 1 for e in eps))
        eps = {e["name"]: e for e in admin(g, "GET", "/admin/endpoints").json()["endpoints"]}
        assert eps[name_b]["inflight"] == 1
        hold.close()
        r = admin(g, "POST", f"/admin/endpoints/{name_b}/drain", {"deadline_s": 60})
        assert r.status_code == 200 and r.json()["state"] == "draining"
        for i in range(5):
            r = httpx.post(
                g.url + "/v1/completions", json={"model": MODEL, "prompt": str(i), "max_tokens": 2}
            )
            assert r.headers["x-unbroken-endpoint"] != name_b
        t.join(30)
        events, resp = out["r"]
        assert resp.headers["x-unbroken-endpoint"] == name_b
        assert stream_text(events, chat=False) == expected_completion("drain me", 300).text
        wait_endpoints(g, lambda eps: name_b not in {e["name"] for e in eps})
    finally:
        for p in (g, a, b):
            p.stop()


def test_stalled_client_does_not_slow_others_or_the_engine(tmp_path: Path) -> None:
    a = engine(tmp_path, name="a")
    cfg = tmp_path / "gw.json"
    cfg.write_text(json.dumps({"stream_buffer_bytes": 64 * 2**20}))
    g = gateway(tmp_path, a.url, args=("--config", str(cfg)))
    try:
        body = {"model": MODEL, "prompt": "p", "max_tokens": 250, "temperature": 0}

        def timed() -> float:
            t0 = time.monotonic()
            events, _ = stream(g.url, "/v1/completions", body)
            assert stream_text(events, chat=False) == expected_completion("p", 250).text
            return time.monotonic() - t0

        base = timed()
        done_before = metric(a.url, "vllm:request_success_total", finished_reason="length")
        # A client that never reads, with a tiny receive buffer, on a stream of ~5 MB: more
        # than the kernel's socket buffers hold, so the gateway must buffer it itself.
        stalled = _raw_stream(
            g.port, {"model": MODEL, "prompt": "stall", "max_tokens": 1500, "n": 16}, rcvbuf=4096
        )
        t0 = time.monotonic()
        # The gateway, not the kernel, holds what the client has not read.
        wait_for(
            lambda: metric(g.url, "unbroken_gateway_stream_buffered_bytes") > 2**20,
            timeout=20,
            what="gateway buffering the stalled stream",
        )
        with_stall = timed()
        # The engine finishes the stalled stream at engine speed (16 sequences end together).
        wait_for(
            lambda: (
                metric(a.url, "vllm:request_success_total", finished_reason="length")
                >= done_before + 17
            ),
            timeout=40,
            what="stalled request finished on the engine",
        )
        engine_time = time.monotonic() - t0
        assert with_stall < base * 2 + 0.5, (base, with_stall)
        assert engine_time < 1500 * 0.005 * 2.5 + 2, engine_time
        assert metric(g.url, "unbroken_gateway_slow_client_aborts_total") == 0
        stalled.close()
    finally:
        g.stop()
        a.stop()


def test_client_too_far_behind_is_cut_and_upstream_freed(tmp_path: Path) -> None:
    a = engine(tmp_path, name="a")
    cfg = tmp_path / "gw.json"
    cfg.write_text(json.dumps({"stream_buffer_bytes": 8192}))
    g = gateway(tmp_path, a.url, args=("--config", str(cfg)))
    try:
        # 16 choices per step: megabytes within seconds, more than any socket buffer holds.
        s = _raw_stream(
            g.port, {"model": MODEL, "prompt": "p", "max_tokens": 3000, "n": 16}, rcvbuf=2048
        )
        wait_for(
            lambda: metric(g.url, "unbroken_gateway_slow_client_aborts_total") == 1, timeout=30
        )
        wait_for(lambda: metric(a.url, "vllm:num_requests_running") == 0, timeout=2)
        s.close()
    finally:
        g.stop()
        a.stop()


def test_caps_priority_order_and_shedding(tmp_path: Path) -> None:
    a = engine(tmp_path, name="a")
    g = gateway(tmp_path, a.url, args=("--cap", "1", "--queue-timeout", "20"))
    try:
        hold = _raw_stream(g.port, {"model": MODEL, "prompt": "x", "max_tokens": 5000})
        wait_endpoints(g, lambda eps: eps[0]["inflight"] == 1)
        finished: list[str] = []

        def req(prio: str) -> None:
            r = httpx.post(
                g.url + "/v1/completions",
                headers={"x-unbroken-priority": prio},
                json={"model": MODEL, "prompt": prio, "max_tokens": 20},
                timeout=30,
            )
            assert r.status_code == 200
            finished.append(prio)

        ts = [threading.Thread(target=req, args=("standard",))]
        ts[0].start()
        wait_for(lambda: metric(g.url, "unbroken_gateway_queue_depth", priority="standard") == 1)
        ts.append(threading.Thread(target=req, args=("critical",)))
        ts[1].start()
        wait_for(lambda: metric(g.url, "unbroken_gateway_queue_depth", priority="critical") == 1)
        r = httpx.post(
            g.url + "/v1/completions",
            headers={"x-unbroken-priority": "sheddable"},
            json={"model": MODEL, "prompt": "s", "max_tokens": 2},
        )
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "shed"
        r = httpx.post(
            g.url + "/v1/completions",
            headers={"x-unbroken-priority": "urgent"},
            json={"model": MODEL, "prompt": "s", "max_tokens": 2},
        )
        assert r.status_code == 400
        hold.close()
        for t in ts:
            t.join(30)
        assert finished == ["critical", "standard"]
        assert metric(g.url, "unbroken_gateway_shed_total", priority="sheddable") == 1
    finally:
        g.stop()
        a.stop()


def test_queue_timeout_answers_429(tmp_path: Path) -> None:
    a = engine(tmp_path, name="a")
    g = gateway(tmp_path, a.url, args=("--cap", "1", "--queue-timeout", "0.5"))
    try:
        hold = _raw_stream(g.port, {"model": MODEL, "prompt": "x", "max_tokens": 5000})
        wait_endpoints(g, lambda eps: eps[0]["inflight"] == 1)
        r = httpx.post(g.url + "/v1/completions", json={"model": MODEL, "prompt": "q"})
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_timeout"
        hold.close()
        r = httpx.post(
            g.url + "/v1/completions", json={"model": MODEL, "prompt": "q", "max_tokens": 2}
        )
        assert r.status_code == 200
    finally:
        g.stop()
        a.stop()


def test_admin_api(shared_gateway: tuple[Proc, Proc, Proc], tmp_path: Path) -> None:
    g, a, _b = shared_gateway
    assert admin(g, "GET", "/admin/endpoints", token=None).status_code == 401
    assert admin(g, "GET", "/admin/endpoints", token="nope").status_code == 401
    assert admin(g, "POST", "/admin/endpoints", {"url": "ftp://x"}).status_code == 400
    assert (
        admin(
            g, "POST", "/admin/endpoints", {"url": a.url, "name": f"127.0.0.1:{a.port}"}
        ).status_code
        == 409
    )
    c = engine(tmp_path, name="c")
    try:
        r = admin(
            g, "POST", "/admin/endpoints", {"url": c.url, "name": "c", "pool": "extra", "cap": 3}
        )
        assert r.status_code == 201 and r.json()["state"] == "starting"
        eps = wait_endpoints(
            g, lambda eps: any(e["name"] == "c" and e["state"] == "ready" for e in eps)
        )
        assert next(e for e in eps if e["name"] == "c")["cap"] == 3
        r = admin(g, "PATCH", "/admin/endpoints/c", {"cap": 9})
        assert r.json()["cap"] == 9
        routes = admin(g, "PUT", "/admin/routes", {"routes": {"sheddable": ["extra"]}}).json()
        assert routes["routes"]["sheddable"] == ["extra"]
        r = httpx.post(
            g.url + "/v1/completions",
            headers={"x-unbroken-priority": "sheddable"},
            json={"model": MODEL, "prompt": "x", "max_tokens": 2},
        )
        assert r.headers["x-unbroken-endpoint"] == "c"
        assert admin(g, "PUT", "/admin/routes", {"routes": {"vip": ["x"]}}).status_code == 400
        admin(g, "PUT", "/admin/routes", {"routes": {}})
        assert admin(g, "DELETE", "/admin/endpoints/c").status_code == 200
        assert admin(g, "GET", "/admin/endpoints/c").status_code == 404
        status = admin(g, "GET", "/admin/status").json()
        assert {"endpoints", "queue", "routes"} <= set(status)
        assert status["routing"] == "prefix"  # the default policy, by name
    finally:
        c.stop()


def test_gateway_metrics_names(shared_gateway: tuple[Proc, Proc, Proc]) -> None:
    g = shared_gateway[0]
    stream(g.url, "/v1/completions", {"model": MODEL, "prompt": "m", "max_tokens": 3})
    for name, labels in [
        ("unbroken_gateway_requests_total", {"status": "200"}),
        ("unbroken_gateway_ttft_seconds_count", {}),
        ("unbroken_gateway_inter_token_seconds_count", {}),
        ("unbroken_gateway_inflight", {}),
        ("unbroken_gateway_queue_depth", {"priority": "critical"}),
        ("unbroken_gateway_endpoint_state", {"state": "ready"}),
    ]:
        metric(g.url, name, **labels)
    assert metric(g.url, "unbroken_gateway_endpoint_state", state="ready") == 2
    # Requests per endpoint, as vllm-router's processed requests per worker: a counter that
    # follows what is sent (the shared gateway serves other tests: counted from here).
    before = metric(g.url, "unbroken_gateway_endpoint_requests_total")
    for i in range(4):
        stream(g.url, "/v1/completions", {"model": MODEL, "prompt": f"n{i}", "max_tokens": 2})
    assert metric(g.url, "unbroken_gateway_endpoint_requests_total") == before + 4
    text = httpx.get(g.url + "/metrics").text
    assert "# TYPE unbroken_gateway_endpoint_requests_total counter" in text


def test_long_header_lines_as_vllm_takes_them(shared_gateway: tuple[Proc, Proc, Proc]) -> None:
    """A 12 KB header line (a long bearer token, a session id a client builds from its
    conversation) is served, as uvicorn in front of vLLM serves it (16 KiB); aiohttp's own
    default of 8 KiB answered 400. Longer still: 400 in OpenAI's format."""
    g = shared_gateway[0]
    body = {"model": "unbroken-sim", "prompt": "x", "max_tokens": 2}
    r = httpx.post(g.url + "/v1/completions", json=body, headers={"X-Long": "a" * 12_000})
    assert r.status_code == 200, r.text
    r = httpx.post(g.url + "/v1/completions", json=body, headers={"X-Long": "a" * 20_000})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    # Not echoed (a header may be a token; aiohttp's message quoted 100 bytes of it), and in
    # the client's HTTP version (aiohttp answered a parser error in 1.0).
    assert "aaaa" not in r.text and r.http_version == "HTTP/1.1", (r.http_version, r.text)


def test_unknown_model_and_bad_input(shared_gateway: tuple[Proc, Proc, Proc]) -> None:
    g = shared_gateway[0]
    r = httpx.post(g.url + "/v1/completions", json={"model": "gpt-9", "prompt": "x"})
    # As OpenAI's API answers an unknown model (its 404s are all invalid_request_error).
    assert r.status_code == 404 and r.json()["error"] == {
        "message": "The model `gpt-9` does not exist.",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }
    r = httpx.get(g.url + "/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(g.url + "/v1/completions", content=b"{", headers={"content-type": "x"})
    assert r.status_code == 400
    big = b'{"model": "unbroken-sim", "prompt": "' + b"a" * (9 * 2**20) + b'"}'
    r = httpx.post(g.url + "/v1/completions", content=big, timeout=30)
    assert r.status_code == 413 and "error" in r.json()


def test_max_body_bytes_flag_raises_the_limit(tmp_path: Path, shared_engine: Proc) -> None:
    """A body over the default 8 MiB (vLLM sets no limit: base64 images) reaches the engine
    when `--max-body-bytes` allows it; over the flag's limit it is OpenAI's 413."""
    g = gateway(tmp_path, shared_engine.url, args=("--max-body-bytes", str(12 * 2**20)))
    try:
        words = "hello " * (9 * 2**20 // 6)
        body = {"model": MODEL, "prompt": words, "max_tokens": 1}
        r = httpx.post(g.url + "/v1/completions", json=body, timeout=60)
        # The engine's own answer (its context limit), not the gateway's 413.
        assert r.status_code == 400 and r.json()["error"]["code"] != "body_too_large", r.text
        r = httpx.post(g.url + "/v1/completions", json={**body, "prompt": words * 2}, timeout=60)
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
        assert "raise it with --max-body-bytes" in r.json()["error"]["message"], r.text
    finally:
        g.stop()


def test_request_timeout_flag_bounds_a_non_streamed_request(tmp_path: Path) -> None:
    """`--request-timeout` (the setting `request_timeout_s`, 600 s by default; before only in
    a config file): a non-streamed answer still being generated at that bound is a 504
    `upstream_timeout` then, naming the bound."""
    e = engine(tmp_path, "--decode-base-s", "0.05", name="slow")  # 200 tokens: ~10 s
    g = gateway(tmp_path, e.url, args=("--request-timeout", "1.5"))
    try:
        t = time.monotonic()
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200}
        r = httpx.post(g.url + "/v1/completions", json=body, timeout=30)
        took = time.monotonic() - t
        assert r.status_code == 504, r.text
        assert r.json()["error"]["code"] == "upstream_timeout", r.text
        assert "1.5 s" in r.json()["error"]["message"], r.text
        assert 1.4 <= took < 5.0, took
    finally:
        g.stop()
        e.stop()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_no_endpoints_answers_503(tmp_path: Path, path: str) -> None:
    g = gateway(tmp_path, wait_ready=0)
    try:
        r = httpx.post(
            g.url + path,
            json={"model": MODEL, "prompt": "x", "messages": [{"role": "user", "content": "x"}]},
        )
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
    finally:
        g.stop()


def test_a_dead_fleet_answers_503_at_once_not_a_queue_timeout(tmp_path: Path) -> None:
    """Every engine of the model killed after it served (a review: each request waited the
    30 s queue timeout and got 429 "at capacity", which the openai client retried to 92 s
    and dashboards counted as load shedding): the first request waits out the grace (a
    replica may come back within a probe or two), then 503 `no_endpoint` without naming the
    internal endpoints; later ones at once. A replica back serves again."""
    engs = [engine(tmp_path, name=f"e{i}") for i in range(2)]
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    g: Proc | None = None
    try:
        g = gateway(tmp_path, *(e.url for e in engs), args=("--cap", "4"))
        assert httpx.post(g.url + "/v1/completions", json=body, timeout=30).status_code == 200
        # vllm-router's probe routes: /readiness follows the fleet, /liveness the process.
        ready = httpx.get(g.url + "/readiness", timeout=10)
        assert ready.status_code == 200 and ready.json()["healthy_workers"] == 2, ready.text
        for e in engs:
            e.signal(signal.SIGKILL)
        wait_endpoints(g, lambda eps: not any(e["healthy"] for e in eps), timeout=30)
        health = httpx.get(g.url + "/health", timeout=10).text
        assert health.count(" down (/health") == 2 and " ready (" not in health, health
        ready = httpx.get(g.url + "/readiness", timeout=10)
        assert ready.status_code == 503 and ready.json()["status"] == "not ready", ready.text
        assert ready.json()["reason"].startswith("no endpoint is ready: "), ready.text
        assert httpx.get(g.url + "/liveness", timeout=10).text == "OK"  # as vllm-router
        for first in (True, False):
            t0 = time.monotonic()
            r = httpx.post(g.url + "/v1/completions", json=body, timeout=60)
            took = time.monotonic() - t0
            assert r.status_code == 503, (r.status_code, r.text)
            err = r.json()["error"]
            assert err["code"] == "no_endpoint" and "down" in err["message"], err
            assert "127.0.0.1" not in err["message"] and r.headers["retry-after"] == "1"
            assert took < (6.0 if first else 1.0), took  # the queue timeout is 30 s
        engs[0].start()  # the same port: the prober brings the endpoint back
        wait_endpoints(g, lambda eps: any(e["healthy"] for e in eps), timeout=30)
        assert httpx.post(g.url + "/v1/completions", json=body, timeout=30).status_code == 200
    finally:
        if g is not None:
            g.stop()
        for e in engs:
            e.stop()


@pytest.mark.parametrize(
    ("states", "starting_too", "dead"),
    [
        (["down", "down"], False, True),
        (["down", "hung"], False, False),  # held out after a hang: tried again, may serve
        (["down", "ready"], False, False),
        (["down", "down"], True, False),  # a replica starting (a replacement, a new pod)
        (["down", "draining"], False, True),
    ],
)
def test_what_counts_as_nothing_to_serve(states: list[str], starting_too: bool, dead: bool) -> None:
    """`Admission._unserved`, the rule behind the dead fleet's 503: only endpoints whose
    health probes fail, or that are leaving, make a model unserved; an endpoint held out for
    a hang is not (a request waiting for it was moved back to it in a second: answering 503
    there broke test_routing_latency's move-back case), nor is a fleet with a replica
    starting (its model is not known yet)."""
    from unbroken.gateway._admission import Admission
    from unbroken.gateway._pool import Endpoint, Pool, State

    pool = Pool(default_cap=4)
    for i, kind in enumerate(states):
        e = ready_endpoint(f"e{i}")
        if kind == "draining":
            e.set_state(State.DRAINING)
        e.healthy = kind == "ready"
        e.down = kind == "down"
        pool.add(e)
    if starting_too:
        pool.add(Endpoint(name="new", url="http://new", pool="default"))  # starting, no models
    why = Admission(pool, queue_timeout=1)._unserved("m", "standard", starting=True)
    assert (why is not None) == dead, why
    if dead:
        assert "e0" not in why and "http" not in why, why  # no internal names to clients


def test_priority_from_api_key(tmp_path: Path) -> None:
    a = engine(tmp_path, name="a")
    cfg = tmp_path / "gw.json"
    cfg.write_text(json.dumps({"priority_keys": {"sk-batch": "sheddable"}, "default_cap": 1}))
    g = gateway(tmp_path, a.url, args=("--config", str(cfg)))
    try:
        hold = _raw_stream(g.port, {"model": MODEL, "prompt": "x", "max_tokens": 5000})
        wait_endpoints(g, lambda eps: eps[0]["inflight"] == 1)
        r = httpx.post(
            g.url + "/v1/completions",
            headers={"Authorization": "Bearer sk-batch"},
            json={"model": MODEL, "prompt": "s", "max_tokens": 2},
        )
        assert r.status_code == 429 and r.json()["error"]["code"] == "shed"
        # An explicit header wins over the key's class.
        hold.close()
        r = httpx.post(
            g.url + "/v1/completions",
            headers={"Authorization": "Bearer sk-batch", "x-unbroken-priority": "critical"},
            json={"model": MODEL, "prompt": "s", "max_tokens": 2},
            timeout=30,
        )
        assert r.status_code == 200
        assert metric(g.url, "unbroken_gateway_requests_total", priority="critical") == 1
    finally:
        g.stop()
        a.stop()
