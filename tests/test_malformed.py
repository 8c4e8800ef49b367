"""Hypothesis throws malformed requests at the engine and the gateway: only 4xx comes back,
never a 5xx, and both keep serving."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import MODEL, Proc, engine, gateway

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False),
    st.text(max_size=30),
)
values = st.recursive(
    scalars,
    lambda c: st.one_of(
        st.lists(c, max_size=4), st.dictionaries(st.text(max_size=8), c, max_size=4)
    ),
    max_leaves=12,
)
FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stream",
    "stream_options",
    "stop",
    "seed",
    "logprobs",
    "top_logprobs",
    "echo",
    "min_tokens",
    "continue_final_message",
    "add_generation_prompt",
    "max_completion_tokens",
    "response_format",
    "tool_choice",
    "ignore_eos",
    "user",
    "return_token_ids",
]
bodies = st.one_of(
    st.binary(max_size=200),
    st.builds(
        lambda d: json.dumps(d).encode(),
        st.dictionaries(st.sampled_from(FIELDS), values, max_size=8),
    ),
    # Mostly-valid requests with one field broken.
    st.builds(
        lambda k, v: json.dumps(
            {
                "model": MODEL,
                "prompt": "x",
                "max_tokens": 2,
                "messages": [{"role": "user", "content": "x"}],
                k: v,
            }
        ).encode(),
        st.sampled_from(FIELDS),
        values,
    ),
)


@pytest.fixture(scope="module")
def targets(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Proc]]:
    tmp: Path = tmp_path_factory.mktemp("malformed")
    e = engine(tmp, "--max-model-len", "48")  # a valid request can never run long
    g = gateway(tmp, e.url)
    yield e, g
    g.stop()
    e.stop()


def _send(client: httpx.Client, url: str, body: bytes) -> int:
    with client.stream(
        "POST", url, content=body, headers={"Content-Type": "application/json"}
    ) as r:
        return r.status_code


@given(body=bodies, path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_only_4xx_never_5xx(targets: tuple[Proc, Proc], body: bytes, path: str) -> None:
    e, g = targets
    with httpx.Client(timeout=20) as c:
        for p in (e, g):
            status = _send(c, p.url + path, body)
            assert status < 500, (p.url, body, status)


@pytest.mark.parametrize("stream", [False, True])
def test_an_empty_prompt_is_a_400_not_a_hang(targets: tuple[Proc, Proc], stream: bool) -> None:
    """`"prompt": ""` is no token at all here (no BOS): vLLM's processor refuses it ("The
    decoder prompt cannot be empty"), and the simulator, which took it, never scheduled it (a
    step samples a sequence's token once it computes its last prompt token): the request
    hung, direct and through the gateway (hypothesis found it, 2026-12-05)."""
    body = {"model": MODEL, "prompt": "", "max_tokens": 2, "stream": stream}
    for p in targets:
        r = httpx.post(p.url + "/v1/completions", json=body, timeout=10)
        assert r.status_code == 400, (p.url, r.status_code, r.text)
        err = r.json()["error"]
        assert err["message"] == "The decoder prompt cannot be empty" and err["param"] == "prompt"
    # A prompt of blanks is one token, as before.
    for p in targets:
        r = httpx.post(p.url + "/v1/completions", json={**body, "prompt": " "}, timeout=10)
        assert r.status_code == 200, (p.url, r.status_code, r.text)


def test_still_serving_afterwards(targets: tuple[Proc, Proc]) -> None:
    for p in targets:
        r = httpx.post(
            p.url + "/v1/completions", json={"model": MODEL, "prompt": "ok", "max_tokens": 3}
        )
        assert r.status_code == 200
        assert httpx.get(p.url + "/health").status_code == 200


@given(body=bodies, chat=st.booleans())
@settings(max_examples=1500, deadline=None)
def test_gateway_reads_any_body_without_raising(body: bytes, chat: bool) -> None:
    """What the gateway reads of a body before the engine sees it (model, stream, fan-out,
    token limit, the prefix hint, the augmented body, whether it could migrate) must answer
    any JSON with a value or an ApiError: a TypeError there is a 500 (CI found
    `"messages": true` reaching the prefix hint through the HTTP test above; this in-process
    copy tries many more shapes in a second)."""
    from unbroken.gateway._continuation import augment, not_migratable
    from unbroken.gateway._prefix import hint_of
    from unbroken.gateway._proxy import _max_tokens, _wants
    from unbroken.wire.openai import ApiError, gateway_view

    try:
        view = gateway_view(body, chat)
    except ApiError as e:
        assert 400 <= e.status < 500
        return
    raw = view.raw
    _wants(raw)
    _max_tokens(raw)
    hint = hint_of(raw, chat, view.model or "m", block_chars=16, session=None)
    assert hint.session is None or isinstance(hint.session, str)
    orjson.dumps(augment(raw))
    for tokens in (False, True):
        why = not_migratable(raw, chat, tokens=tokens)
        assert why is None or isinstance(why, str)


HEADER_VALUES = [b"\xff\xfe", b"Bearer \xff\xfe", b"Bearer", b"", b"x" * 6000, b"caf\xc3\xa9 \x80"]
HEADERS = ["authorization", "x-session-id", "x-unbroken-priority", "x-request-id", "x-api-key"]


@pytest.fixture(scope="module")
def tenant_gateway(
    targets: tuple[Proc, Proc], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Proc]:
    from unbroken.config.tenants import key_digest

    tmp: Path = tmp_path_factory.mktemp("malformed-tenants")
    cfg = tmp / "gw.json"
    cfg.write_text(json.dumps({"tenants": [{"name": "t", "api_keys": [key_digest("sk-t")]}]}))
    g = gateway(tmp, targets[0].url, args=("--config", str(cfg)))
    yield g
    g.stop()


@pytest.mark.parametrize("header", HEADERS)
def test_odd_header_bytes_are_never_a_5xx(
    targets: tuple[Proc, Proc], tenant_gateway: Proc, header: str
) -> None:
    """Header values a client can send that are not text (aiohttp keeps undecodable bytes as
    surrogates): an API key, a session key, a priority, a request id. CI's first such find
    was a session header reaching the session hash as a str that would not encode."""
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2}).encode()
    with httpx.Client(timeout=20) as c:
        for g in (targets[1], tenant_gateway):
            for v in HEADER_VALUES:
                r = c.post(
                    g.url + "/v1/completions",
                    content=body,
                    headers={"Content-Type": "application/json", header: v},
                )
                assert r.status_code < 500, (g.url, header, v[:20], r.status_code, r.text[:200])
