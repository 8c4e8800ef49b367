"""The engine simulator's Responses API (vLLM 0.32's POST /v1/responses, non-harmony path) over
real sockets, with the official openai client: the text equals chat's for the same
conversation, the stream's events come in vLLM's order with its fields, the store follows
VLLM_ENABLE_RESPONSES_API_STORE."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from helpers import MODEL, TOKEN, Proc, engine, metric, wait_for
from unbroken.engine.textmodel import expected_chat

STORE_ENV = "VLLM_ENABLE_RESPONSES_API_STORE"


@pytest.fixture(scope="module")
def store_engine(logdir: Path) -> Iterator[Proc]:
    """An engine started with the store on, as `VLLM_ENABLE_RESPONSES_API_STORE=1 vllm serve`."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(STORE_ENV, "1")
        p = engine(logdir, name="responses-store")
    yield p
    p.stop()


@pytest.fixture(scope="module")
def plain_engine(logdir: Path) -> Iterator[Proc]:
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(STORE_ENV, raising=False)
        p = engine(logdir, name="responses-plain")
    yield p
    p.stop()


def _client(p: Proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=p.url + "/v1", api_key="unused", max_retries=0)


def _chat_text(p: Proc, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    r = httpx.post(
        p.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    return r.json()


def _state(p: Proc) -> dict[str, Any]:
    return httpx.get(
        p.url + "/admin/state", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10
    ).json()


def test_text_and_usage_equal_chat_and_retrieve(store_engine: Proc) -> None:
    msgs = [
        {"role": "system", "content": "answer in one line"},
        {"role": "user", "content": "what is the tallest mountain"},
    ]
    client = _client(store_engine)
    r = client.responses.create(
        model=MODEL,
        instructions="answer in one line",
        input=[{"role": "user", "content": [{"type": "input_text", "text": msgs[1]["content"]}]}],
        max_output_tokens=12,
        temperature=0,
        metadata={"team": "a"},
        user="u-1",
    )
    chat = _chat_text(store_engine, msgs, 12)
    assert r.output_text == chat["choices"][0]["message"]["content"]
    assert r.output_text == expected_chat(msgs, 12).text
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert item.status == "completed"
    (part,) = item.content
    assert part.type == "output_text" and part.annotations == [] and part.logprobs is None
    assert r.usage is not None
    assert r.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert r.usage.output_tokens == chat["usage"]["completion_tokens"] == 12
    assert r.usage.total_tokens == chat["usage"]["total_tokens"]
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    # The echoed parameters, as vLLM's from_request: sampling's values, not the request's.
    assert (r.temperature, r.top_p, r.max_output_tokens) == (0.0, 1.0, 12)
    assert (r.instructions, r.metadata, r.user) == ("answer in one line", {"team": "a"}, "u-1")
    assert r.tool_choice == "none" and r.tools == [] and r.background is False
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()


def test_stream_events_in_vllm_order(store_engine: Proc) -> None:
    client = _client(store_engine)
    n = 6
    events = list(
        client.responses.create(
            model=MODEL, input="tell me a story", max_output_tokens=n, temperature=0, stream=True
        )
    )
    types = [e.type for e in events]
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * n,  # one per token
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    created, progress, added, part_added = events[:4]
    deltas = events[4 : 4 + n]
    text_done, part_done, item_done, completed = events[4 + n :]
    rid = created.response.id
    assert created.response.status == progress.response.status == "in_progress"
    assert created.response.output == [] and created.response.usage is None
    assert created.response.max_output_tokens == n
    item_id = added.item.id
    assert added.output_index == 0 and added.item.status == "in_progress"
    assert added.item.content == [] and added.item.role == "assistant"
    assert part_added.item_id == item_id and part_added.content_index == 0
    assert part_added.part.text == "" and part_added.part.logprobs == []
    assert all(d.item_id == item_id and d.output_index == 0 for d in deltas)
    assert all(d.content_index == 0 and d.logprobs == [] for d in deltas)
    text = "".join(d.delta for d in deltas)
    assert text == expected_chat([("user", "tell me a story")], n).text
    assert text_done.text == part_done.part.text == text and text_done.logprobs == []
    assert part_done.part.logprobs is None
    assert item_done.item.status == "completed" and item_done.item.content[0].text == text
    final = completed.response
    assert final.id == rid and final.status == "incomplete"
    assert final.incomplete_details is not None
    assert final.output[0].model_dump() == item_done.item.model_dump()  # the streamed item
    assert final.usage is not None and final.usage.output_tokens == n
    assert final.usage.input_tokens == 6  # "<|user|>\ntell me a story<|end|>\n<|assistant|>\n"
    assert client.responses.retrieve(rid).model_dump() == final.model_dump()


def test_stream_wire_framing(plain_engine: Proc) -> None:
    """`event:` lines as vLLM writes them (each naming its data's type), no `[DONE]`."""
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 3, "stream": True}
    r = httpx.post(plain_engine.url + "/v1/responses", json=body, timeout=30)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    blocks = r.text.split("\n\n")
    assert blocks[-1] == "" and len(blocks) == 1 + 2 + 2 + 3 + 3 + 1
    for b in blocks[:-1]:
        event, data = b.split("\n")
        obj = orjson.loads(data.removeprefix("data: "))
        assert event == "event: " + obj["type"]
        assert list(obj)[-2:] in (["sequence_number", "type"], ["text", "type"])
    assert "[DONE]" not in r.text


def test_previous_response_id_continues_the_conversation(store_engine: Proc) -> None:
    client = _client(store_engine)
    first = client.responses.create(
        model=MODEL,
        instructions="be terse",
        input="name a colour",
        max_output_tokens=5,
        temperature=0,
    )
    assert (
        first.output_text
        == expected_chat([("system", "be terse"), ("user", "name a colour")], 5).text
    )
    second = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input="and another",
        max_output_tokens=7,
        temperature=0,
        stream=False,
    )
    # vLLM: the previous messages without their system message (instructions do not carry
    # over), the previous output as an assistant message, then the new input.
    convo = [
        {"role": "user", "content": "name a colour"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "and another"},
    ]
    assert second.previous_response_id == first.id
    assert (
        second.output_text == _chat_text(store_engine, convo, 7)["choices"][0]["message"]["content"]
    )
    third = client.responses.create(
        model=MODEL,
        previous_response_id=second.id,
        input="last",
        max_output_tokens=4,
        temperature=0,
    )
    convo += [
        {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "last"},
    ]
    assert third.output_text == expected_chat(convo, 4).text


def test_unknown_ids_404_as_vllm(store_engine: Proc) -> None:
    for path, method in (
        ("/v1/responses/resp_nope", "GET"),
        ("/v1/responses/resp_nope/cancel", "POST"),
    ):
        r = httpx.request(method, store_engine.url + path, timeout=10)
        assert r.status_code == 404
        assert r.json() == {
            "error": {
                "message": "Response with id 'resp_nope' not found.",
                "type": "invalid_request_error",
                "param": "response_id",
                "code": 404,
            }
        }
    with pytest.raises(openai.NotFoundError) as e:
        _client(store_engine).responses.create(
            model=MODEL, input="x", previous_response_id="resp_gone"
        )
    assert e.value.body["message"] == "Response with id 'resp_gone' not found."  # type: ignore[index]


def test_store_is_off_without_the_variable(plain_engine: Proc) -> None:
    """vLLM ignores store=True (the default) unless VLLM_ENABLE_RESPONSES_API_STORE is set: the
    response is answered, never kept."""
    client = _client(plain_engine)
    r = client.responses.create(model=MODEL, input="hello", max_output_tokens=3, store=True)
    assert r.status == "incomplete" and len(r.output_text.split()) == 3
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="more", previous_response_id=r.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="x", background=True)
    assert STORE_ENV in e.value.message


def test_store_false_is_not_kept(store_engine: Proc) -> None:
    client = _client(store_engine)
    r = client.responses.create(model=MODEL, input="hello", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    kept = client.responses.create(model=MODEL, input="hello", max_output_tokens=2)
    assert client.responses.retrieve(kept.id).output_text == kept.output_text
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response"):
        client.responses.cancel(kept.id)


def test_stop_completes_and_max_output_tokens_is_clipped(store_engine: Proc) -> None:
    client = _client(store_engine)
    long = client.responses.create(model=MODEL, input="count", max_output_tokens=10, temperature=0)
    words = long.output_text.split()
    # `stop` is one of vLLM's extra parameters: a stop string ends the answer: completed.
    done = client.responses.create(
        model=MODEL,
        input="count",
        max_output_tokens=10,
        temperature=0,
        extra_body={"stop": [" " + words[3]]},
    )
    assert done.status == "completed" and done.incomplete_details is None
    assert done.output_text == " ".join(words[:3])
    # vLLM 0.32 clips max_output_tokens to the context left (get_max_tokens); only a value
    # beyond max_model_len itself is refused (TokenizeParams); the echo says what it sampled
    # with.
    card = httpx.get(store_engine.url + "/v1/models", timeout=10).json()["data"][0]
    max_len = card["max_model_len"]
    big = client.responses.create(
        model=MODEL,
        input="count",
        max_output_tokens=max_len,
        temperature=0,
        extra_body={"stop": [" " + words[3]]},
    )
    assert big.usage is not None
    assert big.max_output_tokens == max_len - big.usage.input_tokens
    assert big.output_text == done.output_text
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="count", max_output_tokens=10**9)
    assert e.value.body["message"] == (  # type: ignore[index]
        f"max_output_tokens=1000000000 cannot be greater than max_model_len={max_len}. Please "
        "request fewer output tokens. (parameter=max_output_tokens, value=1000000000)"
    )


def test_bad_requests_answer_400_in_openai_format(plain_engine: Proc) -> None:
    url = plain_engine.url + "/v1/responses"
    cases: list[tuple[dict[str, Any], str | None, str]] = [
        ({"input": 5}, "input.str", "invalid_value"),
        (
            {"input": "x", "text": {"format": {"type": "json_schema", "name": "s"}}},
            "text",
            "invalid_value",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "input",
            "unsupported",
        ),
        ({"input": "x", "max_output_tokens": 0}, "max_tokens", "invalid_value"),
        ({"input": "x", "temperature": "hot"}, "temperature", "invalid_value"),
    ]
    for body, param, code in cases:
        r = httpx.post(url, json={"model": MODEL, **body}, timeout=10)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", param, code), (
            err
        )
    r = httpx.post(url, json={"input": "x", "tool_choice": "required"}, timeout=10)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        "Tool choice 'required' must be specified with 'tools' parameter."
    )
    with pytest.raises(openai.BadRequestError) as e:
        _client(plain_engine).responses.create(
            model=MODEL,
            input="x",
            tools=[{"type": "function", "name": "f", "parameters": None, "strict": None}],
            tool_choice={"type": "function", "name": "g"},
        )
    assert e.value.status_code == 400 and "Tool 'g' has not been passed" in e.value.message
    # Accepted as vLLM accepts them (the simulator never calls a tool): echoed.
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    r = httpx.post(
        url,
        json={
            "input": "x",
            "tools": tools,
            "reasoning": {"effort": "low"},
            "max_output_tokens": 2,
            "text": {"format": {"type": "text"}},
        },
        timeout=10,
    )
    assert r.status_code == 200, r.text
    j = r.json()
    assert j["tool_choice"] == "auto" and j["tools"][0]["name"] == "f"
    assert j["reasoning"]["effort"] == "low" and j["text"]["format"] == {"type": "text"}
    assert [o["type"] for o in j["output"]] == ["message"]


def test_client_disconnect_frees_the_request(plain_engine: Proc) -> None:
    """The engine frees the request at once; as vLLM 0.32, a client's abort is counted in no
    metric (`vllm:request_success_total{finished_reason="abort"}` stays), only in the
    simulator's /admin/state."""
    abort_before = metric(plain_engine.url, "vllm:request_success_total", finished_reason="abort")
    aborted = _state(plain_engine)["aborted"]
    body = {"model": MODEL, "input": "go on", "max_output_tokens": 5000, "stream": True}
    with httpx.stream("POST", plain_engine.url + "/v1/responses", json=body, timeout=30) as r:
        deltas = 0
        for line in r.iter_lines():
            if line == "event: response.output_text.delta":
                deltas += 1
                if deltas == 3:
                    assert _state(plain_engine)["requests"] == 1  # still generating
                    break  # leaving the generator closes the connection
    wait_for(lambda: _state(plain_engine)["requests"] == 0, timeout=10, what="request released")
    st = _state(plain_engine)
    assert st["running"] == 0 and st["waiting"] == 0
    assert st["aborted"] == aborted + 1
    assert (
        metric(plain_engine.url, "vllm:request_success_total", finished_reason="abort")
        == abort_before
    )


def test_background_and_cancel(store_engine: Proc) -> None:
    client = _client(store_engine)
    r = client.responses.create(
        model=MODEL, input="a long one", max_output_tokens=5000, background=True
    )
    assert r.status == "queued" and r.output == []
    assert client.responses.retrieve(r.id).status == "queued"
    wait_for(lambda: _state(store_engine)["requests"] == 1, timeout=10, what="running")
    cancelled = client.responses.cancel(r.id)
    assert cancelled.status == "cancelled"
    wait_for(lambda: _state(store_engine)["requests"] == 0, timeout=10, what="request released")
    time.sleep(0.1)
    assert client.responses.retrieve(r.id).status == "cancelled"  # stays cancelled
    short = client.responses.create(
        model=MODEL, input="short", max_output_tokens=3, background=True
    )
    wait_for(
        lambda: client.responses.retrieve(short.id).status == "incomplete",
        timeout=10,
        what="background response stored",
    )
    assert len(client.responses.retrieve(short.id).output_text.split()) == 3
    assert os.environ.get(STORE_ENV) is None  # the fixture's variable stayed in its engine
