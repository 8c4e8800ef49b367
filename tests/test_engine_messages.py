"""Anthropic's Messages API, as vLLM 0.32 serves it beside OpenAI's (engine/messages.py),
with the official `anthropic` SDK (what Claude Code and Anthropic-SDK apps use): straight to
the simulator and through the gateway, messages and streams whose text is the simulator's
own chat text for the same conversation, the token count, and errors in Anthropic's shape.
Real processes over real sockets."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import pytest

from helpers import MODEL, Proc, engine, gateway
from unbroken.engine.textmodel import count_tokens, expected_chat, render_chat

SYSTEM = "You answer in a few words."
ASK = [{"role": "user", "content": "name a river"}]
# Greedy, for a text known in advance (this SDK version has no `temperature` argument).
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Proc]]:
    tmp = tmp_path_factory.mktemp("messages")
    e = engine(tmp)
    g = gateway(tmp, e.url)
    yield e, g
    g.stop()
    e.stop()


def _client(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)


@pytest.mark.parametrize("via", ["engine", "gateway"])
def test_a_message_and_its_stream(stack: tuple[Proc, Proc], via: str) -> None:
    url = stack[0].url if via == "engine" else stack[1].url
    client = _client(url)
    want = expected_chat([("system", SYSTEM), ("user", "name a river")], 7).text
    msg = client.messages.create(
        model=MODEL, max_tokens=7, system=SYSTEM, messages=ASK, extra_body=GREEDY
    )
    assert msg.type == "message" and msg.role == "assistant" and msg.model == MODEL
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == want
    assert msg.stop_reason == "max_tokens" and msg.stop_sequence is None
    ctx = render_chat([("system", SYSTEM), ("user", "name a river")])
    assert msg.usage.input_tokens == count_tokens(ctx) and msg.usage.output_tokens == 7
    with client.messages.stream(
        model=MODEL, max_tokens=7, system=SYSTEM, messages=ASK, extra_body=GREEDY
    ) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == want and final.content[0].text == want
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 7
    # A stop sequence that the text holds ends it there, and says which.
    word = want.split()[2]
    stopped = client.messages.create(
        model=MODEL, max_tokens=7, messages=ASK, system=SYSTEM, extra_body=GREEDY,
        stop_sequences=[word],
    )  # fmt: skip
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert stopped.content[0].text == want[: want.index(word)]
    n = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=ASK)
    assert n.input_tokens == count_tokens(ctx)


def test_a_conversation_with_tool_results_is_read_as_chat(stack: tuple[Proc, Proc]) -> None:
    """An agent's turn: its history holds the assistant's tool call and the tool's result
    (blocks), read as text in order, as vLLM reads them into chat messages."""
    client = _client(stack[1].url)
    call = {"type": "tool_use", "id": "t1", "name": "ls", "input": {"dir": "."}}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": "a.py b.py"}
    history = [
        {"role": "user", "content": [{"type": "text", "text": "list the files"}]},
        {"role": "assistant", "content": [call]},
        {"role": "user", "content": [result]},
    ]
    msg = client.messages.create(model=MODEL, max_tokens=5, messages=history, extra_body=GREEDY)
    pairs = [("user", "list the files"), ("assistant", 'ls{"dir":"."}'), ("user", "a.py b.py")]
    assert msg.content[0].text == expected_chat(pairs, 5).text


def test_errors_are_anthropics(stack: tuple[Proc, Proc]) -> None:
    e, g = stack
    for url in (e.url, g.url):
        client = _client(url)
        with pytest.raises(anthropic.NotFoundError) as nf:
            client.messages.create(model="nope", max_tokens=4, messages=ASK)
        assert "does not exist" in str(nf.value)
        with pytest.raises(anthropic.BadRequestError):
            client.messages.create(model=MODEL, max_tokens=0, messages=ASK)
        # Tools: refused, as a vLLM without a tool-call parser refuses chat's.
        tool = {"name": "ls", "description": "list", "input_schema": {"type": "object"}}
        with pytest.raises(anthropic.BadRequestError):
            client.messages.create(model=MODEL, max_tokens=4, messages=ASK, tools=[tool])
    r = httpx.post(e.url + "/v1/messages", json={"model": MODEL, "messages": ASK}, timeout=10)
    assert r.status_code == 400
    assert r.json() == {
        "type": "error",
        "error": {"type": "BadRequestError", "message": "'max_tokens' is a required property"},
    }
    r = httpx.post(e.url + "/v1/messages", content=b"{", timeout=10)
    assert r.status_code == 400 and r.json()["type"] == "error"


def test_a_gateway_stream_is_the_engines(stack: tuple[Proc, Proc], tmp_path: Path) -> None:
    """Through the gateway the event stream is relayed as the engine wrote it (names,
    order, data), ids aside."""
    e, g = stack
    body = {"model": MODEL, "max_tokens": 5, "messages": ASK, "temperature": 0, "stream": True}

    def events(url: str) -> list[str]:
        with httpx.stream("POST", url + "/v1/messages", json=body, timeout=30) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith(
                "text/event-stream"
            )
            lines = r.read().decode().splitlines()
        return [ln for ln in lines if ln.startswith("event:")]

    got, want = events(g.url), events(e.url)
    assert got == want and want[0] == "event: message_start" and want[-1] == "event: message_stop"
