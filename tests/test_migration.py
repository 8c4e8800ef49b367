"""Mid-stream migration: a stream whose engine dies, hangs, errors or is drained continues on
another engine, and the client receives exactly the text of an unbroken stream."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from helpers import MODEL, TOKEN, Proc, admin, engine, gateway, metric, wait_endpoints, wait_for
from unbroken.engine.textmodel import expected_chat, expected_completion
from unbroken.wire.sse import SSEDecoder

AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[Proc, Proc, Proc]]:
    """Engines `a` (pool primary, preferred) and `b` (pool fallback) behind a gateway with a
    short stall timeout."""
    a = engine(tmp_path, name="a")
    b = engine(tmp_path, name="b")
    cfg = tmp_path / "gw.json"
    cfg.write_text(json.dumps({"stall_timeout_s": 1.0}))
    g = gateway(tmp_path, f"primary={a.url}", f"fallback={b.url}", args=("--config", str(cfg)))
    yield g, a, b
    for p in (g, a, b):
        p.stop()


def read_stream(
    url: str,
    path: str,
    body: dict[str, Any],
    after: int = -1,
    action: Callable[[], None] | None = None,
) -> tuple[list[Any], httpx.Response]:
    """Stream a request; run `action` once `after` token events have arrived."""
    events: list[Any] = []
    dec = SSEDecoder()
    tokens = 0
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as r:
        for chunk in r.iter_raw():
            for ev in dec.feed(chunk):
                if ev.data is None:
                    continue
                obj = "[DONE]" if ev.is_done else orjson.loads(ev.data)
                events.append(obj)
                if isinstance(obj, dict) and any(
                    (c.get("text") or (c.get("delta") or {}).get("content"))
                    for c in obj.get("choices", [])
                ):
                    tokens += 1
                    if tokens == after and action is not None:
                        action()
    return events, r


def text_of(events: list[Any], chat: bool) -> str:
    out = []
    for e in events:
        if isinstance(e, dict):
            for c in e.get("choices", []):
                out.append(
                    ((c.get("delta") or {}).get("content") or "") if chat else c.get("text", "")
                )
    return "".join(out)


def check_one_stream(events: list[Any], chat: bool) -> dict[str, Any]:
    """One id, one created, one finish, at most one role chunk, [DONE] last; returns usage."""
    objs = [e for e in events if isinstance(e, dict)]
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert not any("error" in e for e in objs)
    assert len({e["id"] for e in objs}) == 1 and len({e["created"] for e in objs}) == 1
    finishes = [c["finish_reason"] for e in objs for c in e["choices"] if c.get("finish_reason")]
    assert len(finishes) == 1
    if chat:
        roles = [c for e in objs for c in e["choices"] if "role" in (c.get("delta") or {})]
        assert len(roles) == 1
    usage = [e["usage"] for e in objs if e.get("usage")]
    return usage[-1] if usage else {}


def test_completion_survives_sigkill_byte_exact(pair: tuple[Proc, Proc, Proc]) -> None:
    g, a, _b = pair
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 300,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    events, r = read_stream(
        g.url, "/v1/completions", body, after=60, action=lambda: a.signal(signal.SIGKILL)
    )
    assert r.headers["x-unbroken-endpoint"] == f"127.0.0.1:{a.port}"
    assert text_of(events, chat=False) == expected_completion("Once upon a time", 300).text
    usage = check_one_stream(events, chat=False)
    assert usage == {"prompt_tokens": 4, "completion_tokens": 300, "total_tokens": 304}
    assert metric(g.url, "unbroken_gateway_streams_migrated_total", reason="reset") == 1
    # Exported at 0 from the start (so increase() reads 0), and still 0.
    assert metric(g.url, "unbroken_gateway_streams_dropped_total") == 0


def test_chat_survives_sigkill_byte_exact(pair: tuple[Proc, Proc, Proc]) -> None:
    g, a, b = pair
    msgs = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Tell me a long story"},
    ]
    body = {
        "model": MODEL,
        "messages": msgs,
        "max_tokens": 250,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    events, _ = read_stream(
        g.url, "/v1/chat/completions", body, after=40, action=lambda: a.signal(signal.SIGKILL)
    )
    assert text_of(events, chat=True) == expected_chat(msgs, 250).text
    usage = check_one_stream(events, chat=True)
    assert usage["completion_tokens"] == 250
    direct = httpx.post(
        b.url + "/v1/chat/completions",
        timeout=30,
        json={**body, "stream": False, "stream_options": None},
    ).json()
    assert usage["prompt_tokens"] == direct["usage"]["prompt_tokens"]


def test_stall_timeout_migrates_a_hung_stream(pair: tuple[Proc, Proc, Proc]) -> None:
    g, a, _b = pair
    body = {"model": MODEL, "prompt": "hang on", "max_tokens": 200, "temperature": 0}
    t0 = time.monotonic()
    events, _ = read_stream(
        g.url,
        "/v1/completions",
        body,
        after=30,
        action=lambda: httpx.post(
            a.url + "/admin/faults", headers=AUTH, json={"kind": "hang", "duration_s": 30}
        ),
    )
    assert time.monotonic() - t0 < 15
    assert text_of(events, chat=False) == expected_completion("hang on", 200).text
    check_one_stream(events, chat=False)
    assert metric(g.url, "unbroken_gateway_streams_migrated_total", reason="stall") == 1
    # The hung engine was told: the gateway closed that connection, and the engine aborted
    # the request (its /admin/state count; vLLM's abort counts it in no metric).
    wait_for(
        lambda: httpx.get(a.url + "/admin/state", headers=AUTH).json()["aborted"] >= 1,
        what="the hung engine aborted the stream",
    )


def test_error_event_mid_stream_migrates(pair: tuple[Proc, Proc, Proc]) -> None:
    g, a, _b = pair
    httpx.post(
        a.url + "/admin/faults",
        headers=AUTH,
        json={"kind": "fail", "fraction": 1.0, "after_tokens": 25},
    )
    body = {"model": MODEL, "prompt": "errors happen", "max_tokens": 80, "temperature": 0}
    events, _ = read_stream(g.url, "/v1/completions", body)
    assert text_of(events, chat=False) == expected_completion("errors happen", 80).text
    check_one_stream(events, chat=False)
    assert metric(g.url, "unbroken_gateway_streams_migrated_total", reason="error_event") == 1


_LONG_JSON = {  # a value of 100+ tokens: the stream is still going when its engine dies
    "type": "json_schema",
    "json_schema": {
        "name": "words",
        "schema": {"type": "array", "items": {"type": "string"}, "minItems": 100},
    },
}


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ({"n": 2}, "n>1"),
        ({"logprobs": 1}, "logprobs"),
        # vLLM honours response_format on completions too: a continuation would start a new
        # value after the cut one.
        ({"response_format": _LONG_JSON}, "structured_output"),
    ],
)
def test_unmigratable_request_ends_with_explicit_error(
    pair: tuple[Proc, Proc, Proc], extra: dict[str, Any], why: str
) -> None:
    g, a, _b = pair
    body = {"model": MODEL, "prompt": "x", "max_tokens": 300, **extra}
    events, _ = read_stream(
        g.url, "/v1/completions", body, after=20, action=lambda: a.signal(signal.SIGKILL)
    )
    assert events[-1] == "[DONE]"
    err = events[-2]["error"]
    assert err["code"] == "stream_broken" and why in err["message"]
    assert metric(g.url, "unbroken_gateway_streams_unmigratable_total", reason=why) == 1
    assert metric(g.url, "unbroken_gateway_streams_dropped_total") == 1


def test_drain_deadline_migrates_long_streams(pair: tuple[Proc, Proc, Proc]) -> None:
    g, a, _b = pair
    results: list[tuple[list[Any], httpx.Response]] = []
    prompts = [f"long story {i}" for i in range(3)]

    def run(p: str) -> None:
        results.append(
            read_stream(
                g.url,
                "/v1/completions",
                {"model": MODEL, "prompt": p, "max_tokens": 2000, "temperature": 0},
            )
        )

    ts = [threading.Thread(target=run, args=(p,)) for p in prompts]
    for t in ts:
        t.start()
    name_a = f"127.0.0.1:{a.port}"
    wait_endpoints(g, lambda eps: any(e["name"] == name_a and e["inflight"] == 3 for e in eps))
    time.sleep(0.5)
    t0 = time.monotonic()
    r = admin(g, "POST", f"/admin/endpoints/{name_a}/drain", {"deadline_s": 1.0})
    assert r.status_code == 200
    wait_endpoints(g, lambda eps: name_a not in {e["name"] for e in eps}, timeout=10)
    removed = time.monotonic() - t0
    assert removed < 1.0 + 3.0, removed
    for t in ts:
        t.join(60)
    assert len(results) == 3
    by_prompt = {}
    for events, _ in results:
        text = text_of(events, chat=False)
        check_one_stream(events, chat=False)
        by_prompt[text] = events
    assert set(by_prompt) == {expected_completion(p, 2000).text for p in prompts}
    assert metric(g.url, "unbroken_gateway_streams_migrated_total", reason="drain_deadline") == 3
