"""Structured outputs and forced tool calls on the engine simulator, as vLLM 0.32 serves them:
through the official openai client, streamed and not, over a real socket."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from helpers import MODEL, Proc, engine, stream
from unbroken.engine.structured import Constraint, pieces
from unbroken.engine.textmodel import count_tokens, text_piece_id, token_ids


class Address(BaseModel):
    street: str
    zip_code: int | None = None


class Person(BaseModel):
    name: str
    age: int
    tags: list[str]
    kind: Literal["human", "robot"]
    home: Address
    score: float
    friends: list[Person] = []


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
            "required": ["zone"],
        },
    },
}
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
MSGS = [{"role": "user", "content": "What should I pack for the trip"}]


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    p = engine(tmp_path_factory.mktemp("structured"), name="structured")
    yield p
    p.stop()


def _client(p: Proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=p.url + "/v1", api_key="x", max_retries=0)


def _chat(p: Proc, **body: Any) -> httpx.Response:
    return httpx.post(
        p.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": MSGS, "temperature": 0, **body},
        timeout=30,
    )


def test_pieces_are_the_tokens_of_the_text() -> None:
    """A constrained output's pieces join to its text, one per counted token, their ids the
    prompt tokenizer's (a continuation sending the text back hashes the same blocks)."""
    for seed in range(50):
        text = Constraint("json", Person.model_json_schema()).text(bytes([seed]))
        ps = pieces(text)
        assert "".join(ps) == text
        assert len(ps) == count_tokens(text)
        assert [text_piece_id(p) for p in ps] == token_ids(text)


def test_json_schema_parse_validates_and_is_deterministic(sim: Proc) -> None:
    client = _client(sim)
    done = client.chat.completions.parse(
        model=MODEL,
        messages=MSGS,
        response_format=Person,
        temperature=0,  # type: ignore[arg-type]
    )
    choice = done.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person)
    text = choice.message.content
    assert text is not None
    jsonschema.validate(json.loads(text), Person.model_json_schema())
    assert done.usage is not None and done.usage.completion_tokens == count_tokens(text) > 3
    # Same request, same bytes; streamed, the same text over one chunk per token.
    again = client.chat.completions.parse(
        model=MODEL,
        messages=MSGS,
        response_format=Person,
        temperature=0,  # type: ignore[arg-type]
    )
    assert again.choices[0].message.content == text
    schema_rf = {
        "type": "json_schema",
        "json_schema": {"name": "Person", "schema": Person.model_json_schema(), "strict": True},
    }
    # (The client sends openai's strict form of the schema: another schema, another value.)
    text = _chat(sim, response_format=schema_rf).json()["choices"][0]["message"]["content"]
    Person.model_validate_json(text)
    events, r = stream(
        sim.url,
        "/v1/chat/completions",
        {"model": MODEL, "messages": MSGS, "temperature": 0, "response_format": schema_rf},
    )
    assert r.status_code == 200
    deltas = [
        c["delta"].get("content")
        for e in events
        if isinstance(e, dict)
        for c in e["choices"]
        if c["delta"].get("content")
    ]
    assert "".join(deltas) == text and len(deltas) == count_tokens(text)
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    # Another prompt, another value (seeded from the prompt, as the text is).
    other = _chat(sim, messages=[{"role": "user", "content": "x"}], response_format=schema_rf)
    assert other.json()["choices"][0]["message"]["content"] != text


def test_max_tokens_cuts_the_json(sim: Proc) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "P", "schema": Person.model_json_schema()}}
    full = _chat(sim, response_format=rf).json()["choices"][0]["message"]["content"]
    cut = _chat(sim, response_format=rf, max_tokens=3).json()
    assert cut["choices"][0]["finish_reason"] == "length"
    assert cut["usage"]["completion_tokens"] == 3
    text = cut["choices"][0]["message"]["content"]
    assert full.startswith(text) and text != full
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_json_object_and_structured_outputs(sim: Proc) -> None:
    client = _client(sim)
    r = client.chat.completions.create(
        model=MODEL,
        messages=MSGS,
        response_format={"type": "json_object"},
        temperature=0,  # type: ignore[arg-type]
    )
    assert isinstance(json.loads(r.choices[0].message.content or ""), dict)
    c = client.completions.create(
        model=MODEL,
        prompt="a prompt",
        max_tokens=50,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert isinstance(json.loads(c.choices[0].text), dict) and c.choices[0].finish_reason == "stop"
    for so, check in [
        ({"choice": ["yes", "no", "maybe later"]}, lambda t: t in ("yes", "no", "maybe later")),
        (
            {"regex": r"\d{3}-[a-z]{2,4} (up|down)"},
            lambda t: re.fullmatch(r"\d{3}-[a-z]{2,4} (up|down)", t),
        ),
        (
            {"json": {"type": "array", "items": {"type": "integer"}, "minItems": 2}},
            lambda t: len(json.loads(t)) >= 2,
        ),
    ]:
        r = client.chat.completions.create(
            model=MODEL, messages=MSGS, temperature=0, extra_body={"structured_outputs": so}
        )
        assert check(r.choices[0].message.content), (so, r.choices[0].message.content)
        c = client.completions.create(
            model=MODEL, prompt="p", max_tokens=40, extra_body={"structured_outputs": so}
        )
        assert check(c.choices[0].text), (so, c.choices[0].text)


def test_named_tool_call(sim: Proc) -> None:
    client = _client(sim)
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(
        model=MODEL,
        messages=MSGS,
        tools=[WEATHER, CLOCK],
        tool_choice=choice,
        temperature=0,  # type: ignore[list-item,arg-type]
    )
    ch = r.choices[0]
    assert ch.finish_reason == "stop"  # vLLM: a named call finishes "stop"
    assert ch.message.content == ""
    calls = ch.message.tool_calls or []
    assert len(calls) == 1 and calls[0].type == "function"
    assert calls[0].id.startswith("chatcmpl-tool-")
    assert calls[0].function.name == "get_weather"  # type: ignore[union-attr]
    args = calls[0].function.arguments  # type: ignore[union-attr]
    jsonschema.validate(json.loads(args), PARAMS["get_weather"])
    # Streamed: id, type and name in the first delta, then the arguments as text.
    s = client.chat.completions.create(
        model=MODEL,
        messages=MSGS,
        tools=[WEATHER, CLOCK],  # type: ignore[list-item]
        tool_choice=choice,  # type: ignore[arg-type]
        temperature=0,
        stream=True,
    )
    deltas = [c.choices[0] for c in s if c.choices]
    tcs = [tc for d in deltas for tc in d.delta.tool_calls or []]
    assert tcs[0].id and tcs[0].id.startswith("chatcmpl-tool-") and tcs[0].type == "function"
    assert tcs[0].function and tcs[0].function.name == "get_weather"
    assert all(tc.id is None and tc.function and tc.function.name is None for tc in tcs[1:])
    assert len(tcs) > 2
    assert "".join(tc.function.arguments or "" for tc in tcs if tc.function) == args
    assert deltas[-1].finish_reason == "stop"
    assert all(d.delta.content in (None, "") for d in deltas)


def test_required_tool_calls(sim: Proc) -> None:
    client = _client(sim)
    seen = 0
    for content in ("weather please", "what time is it", "pack", "trip", "now"):
        msgs = [{"role": "user", "content": content}]
        r = client.chat.completions.create(
            model=MODEL,
            messages=msgs,
            tools=[WEATHER, CLOCK],
            tool_choice="required",
            temperature=0,  # type: ignore[list-item,arg-type]
        )
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.content == ""
        calls = ch.message.tool_calls or []
        assert calls
        for call in calls:
            name = call.function.name  # type: ignore[union-attr]
            jsonschema.validate(json.loads(call.function.arguments), PARAMS[name])  # type: ignore[union-attr]
        seen += len(calls)
        events, _ = stream(
            sim.url,
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": msgs,
                "tools": [WEATHER, CLOCK],
                "tool_choice": "required",
                "temperature": 0,
            },
        )
        chunks = [e["choices"][0] for e in events if isinstance(e, dict) and e["choices"]]
        assert chunks[-1]["finish_reason"] == "tool_calls"
        streamed: dict[int, dict[str, str]] = {}
        for c in chunks[1:]:
            for tc in c["delta"].get("tool_calls", []):
                if "id" in tc:  # first delta of a call: vLLM's id, type and name
                    assert tc["type"] == "function" and tc["index"] not in streamed
                    streamed[tc["index"]] = {"name": tc["function"]["name"], "arguments": ""}
                else:
                    assert tc["function"]["name"] is None  # vLLM sends name: null after
                streamed[tc["index"]]["arguments"] += tc["function"]["arguments"]
        assert [(s["name"], s["arguments"]) for s in streamed.values()] == [
            (c.function.name, c.function.arguments)  # type: ignore[union-attr]
            for c in calls
        ]
    assert seen >= 5
    one = _chat(sim, tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False)
    assert len(one.json()["choices"][0]["message"]["tool_calls"]) == 1


def test_required_cut_by_max_tokens_has_no_calls(sim: Proc) -> None:
    r = _chat(sim, tools=[WEATHER], tool_choice="required", max_tokens=2).json()
    ch = r["choices"][0]
    # vLLM: the array does not parse, so no tool_calls (the key left out), content "".
    assert ch["finish_reason"] == "length" and ch["message"] == {"role": "assistant", "content": ""}


def test_auto_tool_choice_answers_text(sim: Proc) -> None:
    r = _chat(sim, tools=[WEATHER], tool_choice="auto", max_tokens=5).json()
    msg = r["choices"][0]["message"]
    assert msg["content"] and "tool_calls" not in msg


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
            "The tool specified in `tool_choice` does not match any of the specified `tools`",
        ),
        (
            {"tool_choice": "required"},
            "tool_choice",
            "When using `tool_choice`, `tools` must be set.",
        ),
        ({"tools": [], "tool_choice": "required"}, "tools", "`tools` must not be an empty array"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {}}},
            "tool_choice.function.name",
            "Expected field `name` in `function` in `tool_choice`!",
        ),
        (
            {"response_format": {"type": "json_schema"}},
            "response_format",
            "When response_format type is 'json_schema', the 'json_schema' field must be",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            None,
            "You must use one kind of structured outputs constraint but none are specified",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "frob"}},
                }
            },
            None,
            "Grammar error: Invalid type: frob",
        ),
        ({"structured_outputs": {"choice": []}}, None, "Choice '[]' cannot be an empty list"),
        (
            {"structured_outputs": {"choice": ["a"], "regex": "a+"}},
            None,
            "You can only use one kind of constraints for structured outputs",
        ),
        ({"structured_outputs": {"regex": "(a"}}, None, "invalid regex"),
    ],
)
def test_vllm_validation_errors(
    sim: Proc, body: dict[str, Any], param: str | None, message: str
) -> None:
    r = _chat(sim, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"], err


def test_n_choices_and_seeds_differ(sim: Proc) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "P", "schema": Person.model_json_schema()}}
    a = _chat(sim, response_format=rf, n=3, temperature=1.0, seed=7).json()
    b = _chat(sim, response_format=rf, n=3, temperature=1.0, seed=7).json()
    texts = [c["message"]["content"] for c in a["choices"]]
    assert texts == [c["message"]["content"] for c in b["choices"]]  # a seed repeats
    assert len(set(texts)) == 3  # each choice its own value
    for t in texts:
        Person.model_validate_json(t)


def test_stop_string_applies(sim: Proc, tmp_path: Path) -> None:
    full = _chat(sim, response_format={"type": "json_object"}).json()["choices"][0]["message"]
    text = full["content"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    r = _chat(sim, response_format={"type": "json_object"}, stop=[stop]).json()["choices"][0]
    assert r["finish_reason"] == "stop" and r["stop_reason"] == stop
    assert r["message"]["content"] == text[: text.index(stop)]


# -- the Responses API ---------------------------------------------------------------------------
R_WEATHER = {
    "type": "function",
    "name": "get_weather",
    **{
        k: WEATHER["function"][k]
        for k in ("description", "parameters")  # type: ignore[index]
    },
}
R_CLOCK = {"type": "function", "name": "get_time", "parameters": PARAMS["get_time"]}


def test_responses_text_format_json_schema(sim: Proc) -> None:
    client = _client(sim)
    fmt = {"type": "json_schema", "name": "person", "schema": Person.model_json_schema()}
    r = client.responses.create(model=MODEL, input="who", temperature=0, text={"format": fmt})  # type: ignore[typeddict-item]
    Person.model_validate_json(r.output_text)
    assert r.text is not None and r.text.format is not None and r.text.format.type == "json_schema"
    # The same conversation on chat answers the same bytes.
    chat = httpx.post(
        sim.url + "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "who"}],
            "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": fmt},
        },
        timeout=30,
    ).json()
    assert chat["choices"][0]["message"]["content"] == r.output_text
    obj = client.responses.create(
        model=MODEL, input="who", text={"format": {"type": "json_object"}}
    )
    assert isinstance(json.loads(obj.output_text), dict)
    parsed = client.responses.parse(model=MODEL, input="who", temperature=0, text_format=Person)
    assert isinstance(parsed.output_parsed, Person)
    deltas = [
        e.delta
        for e in client.responses.create(
            model=MODEL,
            input="who",
            temperature=0,
            text={"format": fmt},
            stream=True,  # type: ignore[typeddict-item]
        )
        if e.type == "response.output_text.delta"
    ]
    assert "".join(deltas) == r.output_text and len(deltas) == count_tokens(r.output_text)


def test_responses_forced_tool_calls(sim: Proc) -> None:
    client = _client(sim)
    named = client.responses.create(
        model=MODEL,
        input="weather",
        temperature=0,
        tools=[R_WEATHER, R_CLOCK],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"},
    )
    assert named.status == "completed"
    [call] = named.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("chatcmpl-tool-") and call.id and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), PARAMS["get_weather"])
    assert named.text is not None and named.text.format is not None
    assert named.text.format.name == "tool_calling_response"  # type: ignore[union-attr]
    events = list(
        client.responses.create(
            model=MODEL,
            input="weather",
            temperature=0,
            tools=[R_WEATHER, R_CLOCK],  # type: ignore[list-item]
            tool_choice={"type": "function", "name": "get_weather"},
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 1 and "".join(deltas) == call.arguments
    assert [e.sequence_number for e in events] == list(range(len(events)))
    required = client.responses.create(
        model=MODEL,
        input="what now",
        temperature=0,
        tools=[R_WEATHER, R_CLOCK],  # type: ignore[list-item]
        tool_choice="required",
    )
    assert required.output and all(o.type == "function_call" for o in required.output)
    for o in required.output:
        jsonschema.validate(json.loads(o.arguments), PARAMS[o.name])  # type: ignore[union-attr]
