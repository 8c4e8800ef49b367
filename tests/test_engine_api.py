"""The engine simulator's OpenAI API over a real socket."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers import MODEL, TOKEN, Proc, engine, metric, stream, stream_text
from unbroken.engine.cli_args import vllm_options
from unbroken.engine.textmodel import expected_chat, expected_completion, sampling_salt


def _post(p: Proc, path: str, body: object, **kw: object) -> httpx.Response:
    return httpx.post(p.url + path, json=body, timeout=30, **kw)  # type: ignore[arg-type]


def test_completion_stream_is_exact_with_usage(shared_engine: Proc) -> None:
    body = {
        "model": MODEL,
        "prompt": "The quick brown",
        "max_tokens": 25,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    events, r = stream(shared_engine.url, "/v1/completions", body)
    # vLLM (Starlette) names the charset of a text/* response.
    assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert events[-1] == "[DONE]"
    token_events = [e for e in events[:-1] if e["choices"]]
    assert len(token_events) == 25  # one event per token
    assert stream_text(events, chat=False) == expected_completion("The quick brown", 25).text
    assert token_events[-1]["choices"][0]["finish_reason"] == "length"
    assert len({e["id"] for e in events[:-1]}) == 1
    usage = events[-2]["usage"]
    assert usage == {"prompt_tokens": 3, "completion_tokens": 25, "total_tokens": 28}


def test_completion_non_stream(shared_engine: Proc) -> None:
    r = _post(
        shared_engine,
        "/v1/completions",
        {"model": MODEL, "prompt": "Once upon", "max_tokens": 12, "temperature": 0},
    )
    assert r.status_code == 200
    j = r.json()
    assert j["object"] == "text_completion"
    assert j["choices"][0]["text"] == expected_completion("Once upon", 12).text
    assert j["usage"]["completion_tokens"] == 12


def test_prompt_ending_mid_sentence_continues(shared_engine: Proc) -> None:
    first = _post(
        shared_engine,
        "/v1/completions",
        {"model": MODEL, "prompt": "Tell me", "max_tokens": 20, "temperature": 0},
    ).json()
    text = first["choices"][0]["text"]
    head = text[: len(text) // 2]
    head = head[: head.rfind(" ")]  # cut on a token boundary
    rest = _post(
        shared_engine,
        "/v1/completions",
        {"model": MODEL, "prompt": "Tell me" + head, "max_tokens": 20, "temperature": 0},
    )
    assert (head + rest.json()["choices"][0]["text"]).startswith(text)


def test_chat_stream_and_continue_final_message(shared_engine: Proc) -> None:
    msgs = [{"role": "system", "content": "be kind"}, {"role": "user", "content": "hello there"}]
    events, r = stream(
        shared_engine.url,
        "/v1/chat/completions",
        {"model": MODEL, "messages": msgs, "max_tokens": 16, "temperature": 0},
    )
    assert r.status_code == 200
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[0]["object"] == "chat.completion.chunk"
    full = expected_chat(msgs, 16).text
    assert stream_text(events, chat=True) == full
    head = " ".join(full.split(" ")[:6])
    cont = _post(
        shared_engine,
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [*msgs, {"role": "assistant", "content": head}],
            "max_tokens": 10,
            "temperature": 0,
            "continue_final_message": True,
            "add_generation_prompt": False,
        },
    )
    assert cont.status_code == 200
    assert head + cont.json()["choices"][0]["message"]["content"] == full


def test_n_choices_and_stop_strings(shared_engine: Proc) -> None:
    r = _post(
        shared_engine,
        "/v1/completions",
        {"model": MODEL, "prompt": "abc", "max_tokens": 5, "temperature": 1, "seed": 7, "n": 3},
    )
    assert [c["index"] for c in r.json()["choices"]] == [0, 1, 2]
    # Each choice's text is known: the seed's salt for its index (vLLM refuses n>1 greedy).
    assert [c["text"] for c in r.json()["choices"]] == [
        expected_completion("abc", 5, salt=sampling_salt(7, i)).text for i in range(3)
    ]
    # The prompt counted once, whatever n (vLLM 0.32 sums it per prompt): it was 3x.
    assert r.json()["usage"] == {"prompt_tokens": 1, "completion_tokens": 15, "total_tokens": 16}
    full = expected_completion("abc", 30).text
    stop = full.split(" ")[5]
    r = _post(
        shared_engine,
        "/v1/completions",
        {"model": MODEL, "prompt": "abc", "max_tokens": 30, "temperature": 0, "stop": [" " + stop]},
    )
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "stop" and c["text"] == full[: full.index(" " + stop)]


USER_HI = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(
    "path", ["/v1/completions", "/v1/chat/completions"], ids=["completions", "chat"]
)
def test_n_with_greedy_sampling_is_refused_as_vllm(shared_engine: Proc, path: str) -> None:
    """vLLM 0.32's SamplingParams: several choices of one greedy request are a 400."""
    body: dict[str, object] = {"model": MODEL, "max_tokens": 2, "temperature": 0, "n": 2}
    body.update({"prompt": "Hi"} if "chat" not in path else {"messages": [USER_HI]})
    r = _post(shared_engine, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == "n must be 1 when using greedy sampling, got 2."
    # Sampled (a temperature, no seed) or n=1: served.
    assert _post(shared_engine, path, {**body, "temperature": 0.5}).status_code == 200
    assert _post(shared_engine, path, {**body, "n": 1}).status_code == 200


def test_stop_reason_names_the_stop_string_as_vllm_does(shared_engine: Proc) -> None:
    """vLLM says which stop string ended a choice (`stop_reason`; null at a length finish):
    on completions in every stream chunk (null until the finishing one) and the full answer;
    on chat only in the finishing chunk (vLLM serialises the others with exclude_unset, so
    they leave the key out) and the full answer."""
    full = expected_completion("abc", 30).text
    stop = " " + full.split(" ")[5]
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 30, "temperature": 0}
    stopped = {**body, "stop": ["never-said", stop]}
    c = _post(shared_engine, "/v1/completions", stopped).json()["choices"][0]
    assert (c["finish_reason"], c["stop_reason"]) == ("stop", stop)
    events, _ = stream(shared_engine.url, "/v1/completions", stopped)
    ch = [e["choices"][0] for e in events[:-1] if e["choices"]]
    assert [x["stop_reason"] for x in ch] == [None] * (len(ch) - 1) + [stop]
    c = _post(shared_engine, "/v1/completions", body).json()["choices"][0]
    assert (c["finish_reason"], c["stop_reason"]) == ("length", None)

    chat = {**body, "messages": [{"role": "user", "content": "abc"}]}
    del chat["prompt"]
    said = _post(shared_engine, "/v1/chat/completions", chat).json()["choices"][0]
    assert (said["finish_reason"], said["stop_reason"]) == ("length", None)
    cstop = " " + said["message"]["content"].split(" ")[4]
    m = _post(shared_engine, "/v1/chat/completions", {**chat, "stop": [cstop]}).json()
    assert (m["choices"][0]["finish_reason"], m["choices"][0]["stop_reason"]) == ("stop", cstop)
    events, _ = stream(shared_engine.url, "/v1/chat/completions", {**chat, "stop": [cstop]})
    ch = [e["choices"][0] for e in events[:-1] if e["choices"]]
    assert all("stop_reason" not in x for x in ch[:-1]) and len(ch) > 2
    assert (ch[-1]["finish_reason"], ch[-1]["stop_reason"]) == ("stop", cstop)


def test_logprobs_shapes(shared_engine: Proc) -> None:
    r = _post(
        shared_engine,
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 3,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 1,
        },
    ).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(c["logprob"] <= 0 for c in content)
    r = _post(
        shared_engine,
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "max_tokens": 3, "temperature": 0, "logprobs": 1},
    ).json()
    assert len(r["choices"][0]["logprobs"]["token_logprobs"]) == 3


def test_logprobs_count_and_echo_as_vllm(shared_engine: Proc) -> None:
    """vLLM returns `top_logprobs` / `logprobs` alternatives per token (the sampled one
    among them), and with `echo` the prompt's tokens first (the first without a logprob),
    `text_offset` running through prompt and answer. The simulator returned one entry, no
    prompt tokens, and offsets from 0 at the answer (a helper's review)."""
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 4,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
    }
    for c in _post(shared_engine, "/v1/chat/completions", chat).json()["choices"][0]["logprobs"][
        "content"
    ]:
        top = c["top_logprobs"]
        assert len(top) == 3 and top[0]["token"] == c["token"], c
        assert len({t["token"] for t in top}) == 3
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
    body = {"model": MODEL, "prompt": "hi  there", "max_tokens": 3, "temperature": 0}
    r = _post(shared_engine, "/v1/completions", {**body, "logprobs": 2}).json()
    lp = r["choices"][0]["logprobs"]
    assert [len(t) for t in lp["top_logprobs"]] == [2, 2, 2]
    assert all(
        next(iter(t)) == tok for t, tok in zip(lp["top_logprobs"], lp["tokens"], strict=True)
    )
    r = _post(shared_engine, "/v1/completions", {**body, "logprobs": 2, "echo": True}).json()
    ch = r["choices"][0]
    lp = ch["logprobs"]
    assert "".join(lp["tokens"]) == ch["text"] and ch["text"].startswith("hi  there")
    assert lp["tokens"][:2] == ["hi", "  there"] and lp["token_logprobs"][0] is None
    assert lp["top_logprobs"][0] is None and len(lp["top_logprobs"][1]) == 2
    offsets = [sum(map(len, lp["tokens"][:j])) for j in range(len(lp["tokens"]))]
    assert lp["text_offset"] == offsets
    events, _ = stream(
        shared_engine.url, "/v1/completions", {**body, "logprobs": 1, "echo": True, "stream": True}
    )
    toks = [t for e in events if isinstance(e, dict) for t in e["choices"][0]["logprobs"]["tokens"]]
    assert "".join(toks) == "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict))


def test_models_health_metrics(shared_engine: Proc) -> None:
    models = httpx.get(shared_engine.url + "/v1/models").json()
    assert models["data"][0]["id"] == MODEL
    # vLLM's ModelCard: a creation time and one model_permission (was `created: 0`, none).
    card = models["data"][0]
    assert abs(card["created"] - time.time()) < 3600
    (perm,) = card["permission"]
    assert perm["object"] == "model_permission" and perm["id"].startswith("modelperm-")
    assert perm["allow_sampling"] is True and perm["organization"] == "*"
    again = httpx.get(shared_engine.url + "/v1/models").json()["data"][0]
    assert again == card  # the same card at every call (the gateway's merged list is equal)
    assert httpx.get(shared_engine.url + "/health").status_code == 200
    # vLLM's /ping (GET and POST), the same answer as /health.
    assert httpx.get(shared_engine.url + "/ping").status_code == 200
    assert httpx.post(shared_engine.url + "/ping").status_code == 200
    before = metric(shared_engine.url, "vllm:generation_tokens_total")
    _post(shared_engine, "/v1/completions", {"model": MODEL, "prompt": "m", "max_tokens": 7})
    assert metric(shared_engine.url, "vllm:generation_tokens_total") == before + 7
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:prompt_tokens_total",
    ):
        metric(shared_engine.url, name)
    assert metric(shared_engine.url, "vllm:request_success_total", finished_reason="length") >= 1
    assert metric(shared_engine.url, "unbroken_engine_cuda_stub_loaded") == 1


def test_stream_null_is_a_plain_request_as_in_vllm(shared_engine: Proc) -> None:
    """vLLM types `stream` as `bool | None`: null is a plain (non-streamed) answer."""
    body = {"model": MODEL, "prompt": "null stream", "max_tokens": 4, "stream": None}
    r = _post(shared_engine, "/v1/completions", body)
    assert r.status_code == 200 and r.json()["choices"][0]["text"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": None}
    r = _post(shared_engine, "/v1/chat/completions", {**chat, "max_tokens": 4})
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"
    r = _post(shared_engine, "/v1/completions", {**body, "stream_options": {}})
    assert r.status_code == 400  # stream options only with stream true, as vLLM


def test_a_request_without_model_is_served_by_the_model_as_in_vllm(shared_engine: Proc) -> None:
    """vLLM 0.32 types `model` as `str | None`: absent, null or "" is its served model (the
    answer names it); an unknown name is still a 404."""
    want = expected_completion("no model", 5).text
    for extra in ({}, {"model": None}, {"model": ""}):
        body = {"prompt": "no model", "max_tokens": 5, "temperature": 0, **extra}
        r = _post(shared_engine, "/v1/completions", body)
        assert r.status_code == 200, (extra, r.text)
        assert r.json()["model"] == MODEL and r.json()["choices"][0]["text"] == want
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    r = _post(shared_engine, "/v1/chat/completions", chat)
    assert r.status_code == 200 and r.json()["model"] == MODEL
    assert _post(shared_engine, "/v1/completions", {**body, "model": "nope"}).status_code == 404


def test_continuous_usage_only_with_include_usage_as_vllm(shared_engine: Proc) -> None:
    """vLLM sends usage on each chunk only for include_usage and continuous_usage_stats."""
    body = {"model": MODEL, "prompt": "usage", "max_tokens": 4, "stream": True}
    for opts, every in (
        ({"continuous_usage_stats": True}, False),
        ({"include_usage": True, "continuous_usage_stats": True}, True),
    ):
        events, _ = stream(shared_engine.url, "/v1/completions", {**body, "stream_options": opts})
        chunks = [e for e in events if isinstance(e, dict) and e.get("choices")]
        assert chunks and all(("usage" in c) == every for c in chunks), (opts, chunks)
        assert any("usage" in e for e in events if isinstance(e, dict)) == every


def test_system_fingerprint_where_vllm_puts_it(shared_engine: Proc) -> None:
    """vLLM (`--fingerprint-mode full`, its default): in a whole answer; in a stream on each
    choice's finishing chunk, or only on the usage chunk when one follows."""
    from unbroken.engine.render import FINGERPRINT

    for path, extra in (
        ("/v1/completions", {"prompt": "fp", "n": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "fp"}], "n": 2}),
    ):
        body = {"model": MODEL, "max_tokens": 3, **extra}
        assert _post(shared_engine, path, body).json()["system_fingerprint"] == FINGERPRINT
        for opts, on in ((None, "finish"), ({"include_usage": True}, "usage")):
            b = {**body, "stream": True, **({"stream_options": opts} if opts else {})}
            events, _ = stream(shared_engine.url, path, b)
            chunks = [e for e in events if isinstance(e, dict)]
            marked = [c for c in chunks if "system_fingerprint" in c]
            assert all(c["system_fingerprint"] == FINGERPRINT for c in marked)
            if on == "finish":
                assert len(marked) == 2  # n = 2: each choice's last chunk
                assert all(c["choices"][0]["finish_reason"] for c in marked)
            else:
                assert len(marked) == 1 and marked[0]["choices"] == [] and "usage" in marked[0]


BAD = [
    ("/v1/completions", b"{not json", 400),
    ("/v1/completions", b"[1, 2]", 400),
    ("/v1/completions", b'{"model": "unbroken-sim"}', 400),
    ("/v1/completions", b'{"model": "unbroken-sim", "prompt": 5}', 400),
    ("/v1/completions", b'{"model": "unbroken-sim", "prompt": "x", "max_tokens": "five"}', 400),
    ("/v1/completions", b'{"model": "unbroken-sim", "prompt": "x", "max_tokens": 2.5}', 400),
    ("/v1/completions", b'{"model": "unbroken-sim", "prompt": "x", "max_tokens": -1}', 400),
    ("/v1/completions", b'{"model": "unbroken-sim", "prompt": "x", "max_tokens": 99999999}', 400),
    ("/v1/completions", b'{"model": "unbroken-sim", "prompt": "x", "max_tokens": 20000}', 400),
    ("/v1/completions", b'{"model": "unbroken-sim", "prompt": "x", "temperature": 9}', 400),
    ("/v1/completions", b'{"model": "unbroken-sim", "prompt": "x", "stream": "maybe"}', 400),
    ("/v1/completions", b'{"model": "unbroken-sim", "prompt": []}', 400),
    ("/v1/completions", b'{"model": "unbroken-sim", "prompt": [1, 2, -5]}', 400),
    ("/v1/completions", b'{"model": "unbroken-sim", "prompt": [[1], [-1]]}', 400),
    ("/v1/completions", b'{"model": "nope", "prompt": "x"}', 404),
    ("/v1/chat/completions", b'{"model": "unbroken-sim", "messages": []}', 400),
    ("/v1/chat/completions", b'{"model": "unbroken-sim", "messages": [{"content": "x"}]}', 400),
    ("/v1/chat/completions", b'{"model": "unbroken-sim", "messages": "hi"}', 400),
    (
        "/v1/chat/completions",
        b'{"model": "unbroken-sim", "messages": [{"role": "user", "content": "x"}], '
        b'"continue_final_message": true}',
        400,
    ),
    (
        "/v1/chat/completions",
        b'{"model": "unbroken-sim", "messages": [{"role": "user", "content": "x"}], '
        b'"response_format": {"type": "json_schema"}}',
        400,
    ),
]


@pytest.mark.parametrize(("path", "body", "status"), BAD)
def test_bad_input_gets_openai_4xx(
    shared_engine: Proc, path: str, body: bytes, status: int
) -> None:
    r = httpx.post(
        shared_engine.url + path, content=body, headers={"Content-Type": "application/json"}
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]


# vLLM 0.32's SamplingParams._verify_args, its words (a review found each served here).
VLLM_REFUSES = [
    ({"top_k": -2}, "top_k must be 0 (disable), or at least 1, got -2."),
    ({"min_p": 2}, "min_p must be in [0, 1], got 2.0."),
    ({"repetition_penalty": 0}, "repetition_penalty must be greater than zero, got 0.0."),
    ({"min_tokens": 10, "max_tokens": 5},
     "min_tokens must be less than or equal to max_tokens=5, got 10."),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "said"), VLLM_REFUSES)
@pytest.mark.parametrize("chat", [False, True])
def test_sampling_values_vllm_refuses_are_refused_in_its_words(
    shared_engine: Proc, extra: dict[str, Any], said: str, chat: bool
) -> None:
    body: dict[str, Any] = {"model": "unbroken-sim", **extra}
    if chat:
        body["messages"] = [{"role": "user", "content": "x"}]
    else:
        body["prompt"] = "x"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    r = httpx.post(shared_engine.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == said
    # Within the bounds: served.
    ok = {**body, "top_k": -1, "min_p": 0.5, "repetition_penalty": 1.1, "min_tokens": 2}
    ok["max_tokens"] = 3
    assert httpx.post(shared_engine.url + path, json=ok, timeout=30).status_code == 200


LENIENT = [
    # (body, what the answer must show): values vLLM 0.32's pydantic models take in lax mode
    ({"prompt": "x", "max_tokens": "5"}, lambda o: o["usage"]["completion_tokens"] == 5),
    ({"prompt": "x", "max_tokens": 3.0}, lambda o: o["usage"]["completion_tokens"] == 3),
    ({"prompt": "x", "max_tokens": 2, "stream": "false"}, lambda o: o["choices"]),
    ({"prompt": "x", "max_tokens": 2, "temperature": "0"}, lambda o: o["choices"]),
    ({"prompt": "x", "max_tokens": 2, "logprobs": True}, lambda o: o["choices"][0]["logprobs"]),
    ({"prompt": "x", "max_tokens": 2, "n": 2.0, "temperature": 1},
     lambda o: len(o["choices"]) == 2),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "seed": "1"},
     lambda o: o["choices"][0]["message"]["content"]),
    ({"messages": [{"role": "narrator", "content": "x"}], "max_tokens": 2},
     lambda o: o["choices"][0]["message"]["content"]),
]  # fmt: skip


@pytest.mark.parametrize(("body", "check"), LENIENT)
def test_lenient_values_are_served_as_vllm_serves_them(
    shared_engine: Proc, body: dict[str, Any], check: Any
) -> None:
    """vLLM's request models are pydantic's lax mode (a review against vLLM 0.32: `"5"`,
    `3.0`, `"0"`, `true` for 1, a custom role: 200 there, 400 here before)."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = httpx.post(shared_engine.url + path, json={"model": "unbroken-sim", **body}, timeout=30)
    assert r.status_code == 200, r.text
    assert check(r.json()), r.json()
    # A stream asked for as vLLM reads "true": SSE events.
    r = httpx.post(
        shared_engine.url + "/v1/completions",
        json={"model": "unbroken-sim", "prompt": "x", "max_tokens": 2, "stream": "true"},
        timeout=30,
    )
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")


def test_oversized_body_and_unknown_route(shared_engine: Proc) -> None:
    big = b'{"model": "unbroken-sim", "prompt": "' + b"a" * (17 * 2**20) + b'"}'
    r = httpx.post(shared_engine.url + "/v1/completions", content=big, timeout=30)
    assert r.status_code == 413 and "error" in r.json()
    r = httpx.get(shared_engine.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(shared_engine.url + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_admin_requires_token(shared_engine: Proc) -> None:
    r = httpx.get(shared_engine.url + "/admin/state")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.get(shared_engine.url + "/admin/state", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    r = httpx.get(shared_engine.url + "/admin/state", headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200 and r.json()["model"] == MODEL
    r = httpx.post(
        shared_engine.url + "/admin/faults",
        json={"kind": "melt"},
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    assert r.status_code == 400


def test_max_tokens_is_clipped_to_the_context_left_as_vllm(tmp_path: Path) -> None:
    """vLLM 0.32 refuses only max_tokens beyond max_model_len or a prompt that alone exceeds
    it (TokenizeParams); otherwise get_max_tokens clips the request to the context left."""
    p = engine(tmp_path, "--max-model-len", "64")
    try:
        prompt = " ".join(["the"] * 10)  # 10 tokens: 54 left
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 60, "temperature": 0}
        r = _post(p, "/v1/completions", body)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        assert c["finish_reason"] == "length"
        assert c["text"] == expected_completion(prompt, 54).text
        usage = {"prompt_tokens": 10, "completion_tokens": 54, "total_tokens": 64}
        assert r.json()["usage"] == usage
        msgs = [{"role": "user", "content": prompt}]
        for limit in ("max_tokens", "max_completion_tokens"):
            r = _post(p, "/v1/chat/completions", {"model": MODEL, "messages": msgs, limit: 64})
            assert r.status_code == 200, r.text
            u = r.json()["usage"]
            assert u["total_tokens"] == 64 and r.json()["choices"][0]["finish_reason"] == "length"
        # Refused as vLLM refuses, in its words.
        r = _post(p, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 65})
        assert r.status_code == 400 and r.json()["error"]["message"] == (
            "max_tokens=65 cannot be greater than max_model_len=64. Please request fewer "
            "output tokens. (parameter=max_tokens, value=65)"
        )
        body = {"model": MODEL, "messages": msgs, "max_completion_tokens": 99}
        r = _post(p, "/v1/chat/completions", body)
        assert r.status_code == 400
        assert r.json()["error"]["message"].startswith("max_completion_tokens=99 cannot be")
        long = " ".join(["the"] * 70)
        r = _post(p, "/v1/completions", {"model": MODEL, "prompt": long, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["message"] == (
            "This model's maximum context length is 64 tokens. However, your prompt contains "
            "at least 65 input tokens, which exceeds this limit even without any output tokens. "
            "Please reduce the length of the input prompt. (parameter=input_tokens, value=65)"
        )  # vLLM tokenizes a text prompt truncated to max_model_len + 1
        r = _post(p, "/v1/completions", {"model": MODEL, "prompt": [5] * 70, "max_tokens": 1})
        assert r.status_code == 400
        assert "contains 70 input tokens" in r.json()["error"]["message"]  # ids: counted whole
        full = " ".join(["the"] * 64)  # fills the context: 0 tokens left
        r = _post(p, "/v1/completions", {"model": MODEL, "prompt": full, "max_tokens": 5})
        assert r.status_code == 400
        assert r.json()["error"]["message"].startswith("max_tokens must be at least 1, got 0.")
    finally:
        p.stop()


def test_cors_is_off_by_default_as_vllm(shared_engine: Proc) -> None:
    """vLLM 0.32's `--allowed-origins` defaults to []: every preflight is refused (Starlette's
    400) and no answer says an origin may read it."""
    pre = {"Origin": "http://x.example", "Access-Control-Request-Method": "POST"}
    r = httpx.options(shared_engine.url + "/v1/chat/completions", headers=pre)
    assert r.status_code == 400 and r.text == "Disallowed CORS origin"
    r = httpx.get(shared_engine.url + "/v1/models", headers={"Origin": "http://x.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_allowed_origins_flag_as_vllm(tmp_path: Path) -> None:
    assert vllm_options(["--allowed-origins", '["*"]'])["allowed_origins"] == ("*",)
    assert vllm_options([])["allowed_origins"] == ()
    for bad in ("*", '{"a": 1}', "[1]"):
        with pytest.raises(ValueError, match="allowed-origins"):
            vllm_options(["--allowed-origins", bad])
    p = engine(tmp_path, "--allowed-origins", '["http://ok.example"]')
    try:
        url = p.url + "/v1/completions"
        ok = {"Origin": "http://ok.example", "Access-Control-Request-Method": "POST"}
        r = httpx.options(url, headers=ok)
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "http://ok.example"
        r = httpx.options(url, headers={**ok, "Origin": "http://evil.example"})
        assert r.status_code == 400
        r = httpx.get(p.url + "/v1/models", headers={"Origin": "http://ok.example"})
        assert r.headers["access-control-allow-origin"] == "http://ok.example"
    finally:
        p.stop()
