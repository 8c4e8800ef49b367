"""Issue 21, finding 4: every request field that changes what the text means either continues
exactly across a migration or ends with an explicit error event, never a silent difference.
Each case runs once straight on engine `b` (the reference: the simulator's text is a pure
function of seed and context) and once through the gateway with engine `a` made to fail
after a few tokens (the simulator's fault injection), so that the stream migrates to `b`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from helpers import MODEL, TOKEN, Proc, engine, gateway

AUTH = {"Authorization": f"Bearer {TOKEN}"}
BASE: dict[str, Any] = {"model": MODEL, "max_tokens": 40, "temperature": 0, "stream": True}

# (name, fields added to BASE); prompt is "fields <name>" unless the case gives one.
CASES: list[tuple[str, dict[str, Any]]] = [
    ("plain", {}),
    ("echo", {"echo": True}),
    ("echo_usage", {"echo": True, "stream_options": {"include_usage": True}}),
    ("include_usage", {"stream_options": {"include_usage": True}}),
    ("stop", {"stop": ["zzzz never"]}),
    ("min_tokens", {"min_tokens": 30}),
    ("ignore_eos", {"ignore_eos": True}),
    ("seed", {"seed": 7}),
    ("logit_bias", {"logit_bias": {"5": -100}}),
    ("skip_special_tokens", {"skip_special_tokens": False}),
    ("suffix", {"suffix": " the end"}),
    ("logprobs_echo", {"logprobs": 1, "echo": True}),
    ("best_of", {"best_of": 2, "n": 1}),
    # Sampled and seeded: vLLM refuses n>1 with greedy sampling (BASE's temperature 0).
    ("n", {"n": 2, "temperature": 1, "seed": 7}),
]


@pytest.fixture(scope="module")
def plane(logdir: Path) -> Iterator[tuple[Proc, Proc, Proc]]:
    a = engine(logdir, name="fields-a")
    b = engine(logdir, name="fields-b")
    cfg = logdir / "fields-gw.json"
    cfg.write_text(json.dumps({"stall_timeout_s": 1.0}))
    g = gateway(logdir, f"primary={a.url}", f"fallback={b.url}", args=("--config", str(cfg)))
    yield g, a, b
    for p in (g, a, b):
        p.stop()


def _events(url: str, body: dict[str, Any]) -> tuple[int, list[Any]]:
    """Every event's decoded data ("[DONE]" as a string); the status alone when not 200."""
    out: list[Any] = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, []
        buf = b""
        for c in r.iter_raw():
            buf += c
            while b"\n\n" in buf:
                ev, buf = buf.split(b"\n\n", 1)
                if ev.startswith(b"data: "):
                    d = ev[6:]
                    out.append("[DONE]" if d == b"[DONE]" else orjson.loads(d))
    return 200, out


def _texts(events: list[Any]) -> dict[int, str]:
    t: dict[int, str] = {}
    for e in events:
        if isinstance(e, dict):
            for c in e.get("choices") or ():
                t[c.get("index", 0)] = t.get(c.get("index", 0), "") + (c.get("text") or "")
    return t


def _usage(events: list[Any]) -> list[dict[str, Any]]:
    return [e["usage"] for e in events if isinstance(e, dict) and e.get("usage")]


@pytest.mark.parametrize(("name", "extra"), CASES, ids=[c[0] for c in CASES])
def test_field_survives_migration_or_errors(
    plane: tuple[Proc, Proc, Proc], name: str, extra: dict[str, Any]
) -> None:
    g, a, b = plane
    body = {**BASE, "prompt": f"fields {name}", **extra}
    st, ref = _events(b.url, body)
    if st != 200:
        # The engine refuses this request outright: nothing to migrate, and the gateway must
        # pass the same refusal through in OpenAI's error format, not turn it into a stream.
        r = httpx.post(g.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == st, (name, r.status_code, r.text)
        assert r.json()["error"]["type"], r.text
        return
    r = httpx.post(
        a.url + "/admin/faults",
        headers=AUTH,
        json={"kind": "fail", "fraction": 1.0, "after_tokens": 8},
    )
    assert r.status_code < 300, r.text
    try:
        st, got = _events(g.url, body)
    finally:
        httpx.delete(a.url + "/admin/faults", headers=AUTH)
    assert st == 200
    assert got and got[-1] == "[DONE]"
    errors = [e for e in got if isinstance(e, dict) and "error" in e]
    if errors:  # an explicit end is allowed; then nothing after it but [DONE]
        assert got.index(errors[0]) == len(got) - 2, got[-3:]
        return
    assert _texts(got) == _texts(ref), name
    finish = [
        c["finish_reason"]
        for e in got
        if isinstance(e, dict)
        for c in e.get("choices") or ()
        if c.get("finish_reason")
    ]
    ref_finish = [
        c["finish_reason"]
        for e in ref
        if isinstance(e, dict)
        for c in e.get("choices") or ()
        if c.get("finish_reason")
    ]
    assert finish == ref_finish
    if body.get("stream_options", {}).get("include_usage"):
        u, ru = _usage(got), _usage(ref)
        assert len(u) == len(ru) == 1, (u, ru)  # usage once, summed over the legs
        assert u[0]["completion_tokens"] == ru[0]["completion_tokens"]
        assert u[0]["prompt_tokens"] == ru[0]["prompt_tokens"]
