"""Engine routes whose answer depends on the replica asked, and OpenAI's rate-limit details:
stored Responses live on the replica that made them (a follow-up turn and GET by id find
it), the Responses API's usage counts against a tenant's token limits (streamed or not),
runtime LoRA adapters go to every replica of their base, `/ping` answers as `/health`, a
bad key on a /v1 path without a route gets 401 before 404/405 (vLLM's order), and the
`x-ratelimit-reset-*` durations are Go's text as OpenAI sends it.

The engines are the simulator (its Responses API, with vLLM's store on) and, for the cases
the simulator cannot make (a refused adapter load, usage of a set size), a stand-in for
vLLM's Responses and adapter routes, `tests/responses_engine.py`; all real processes."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from helpers import MODEL, Proc, admin, engine, gateway, metric
from unbroken.config.tenants import key_digest
from unbroken.gateway._engine_routes import ResponseHomes, StreamScan
from unbroken.gateway._ratelimit import Lease, reset_text
from unbroken.wire.http import free_port
from unbroken.wire.openai import usage_of

HERE = Path(__file__).parent
KEY = "sk-tok-secret"  # a tenant with a token limit
FREE = "sk-free-secret"  # one without


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (0.0004, "1ms"),
        (0.02, "20ms"),
        (0.9996, "1s"),
        (1, "1s"),
        (8.64, "8.64s"),
        (59.96, "59.96s"),
        (60, "1m0s"),
        (61.5, "1m1.5s"),
        (119.6, "1m59.6s"),
        (3599.7, "59m59.7s"),
        (3605, "1h0m5s"),
        (7260.4, "2h1m0.4s"),
    ],
)
def test_reset_durations_are_go_durations(seconds: float, text: str) -> None:
    """OpenAI's `x-ratelimit-reset-*` values (`6m0s`, `8.64s`, `20ms`): never `60s` or
    `1m60s`, rounded up to the millisecond."""
    assert reset_text(seconds) == text


def test_usage_of_reads_every_api() -> None:
    assert usage_of({"usage": {"prompt_tokens": 3, "completion_tokens": 4}}) == (3, 4)
    assert usage_of({"usage": {"input_tokens": 5, "output_tokens": 6}}) == (5, 6)
    event = {"type": "response.completed", "response": {"usage": {"input_tokens": 1}}}
    assert usage_of(event) == (1, None)
    assert usage_of({"type": "response.created", "response": {"usage": None}}) is None
    assert usage_of({"usage": {"prompt_tokens": True}}) == (None, None)
    assert usage_of([1]) is None


def test_stream_scan_charges_totals_and_notes_the_id() -> None:
    """Split anywhere, a Responses stream's last usage is charged and its id noted."""
    charged: list[tuple[int | None, int | None]] = []
    homes = ResponseHomes()

    class Ep:
        name = "ep-a"

    lease = Lease("t", 0)
    scan = StreamScan(Ep(), homes, lease, lambda _l, p, c: charged.append((p, c)))  # type: ignore[arg-type]
    created = {"type": "response.created", "response": {"id": "resp_1", "usage": None}}
    done = {
        "type": "response.completed",
        "response": {"id": "resp_1", "usage": {"input_tokens": 7, "output_tokens": 30}},
    }
    raw = b"".join(
        b"event: " + e["type"].encode() + b"\ndata: " + json.dumps(e).encode() + b"\n\n"
        for e in (created, done)
    )
    for i in range(0, len(raw), 7):
        scan.feed(raw[i : i + 7])
    assert charged == [(7, 30)]
    assert homes.get("resp_1") == "ep-a"


def test_response_homes_are_bounded() -> None:
    homes = ResponseHomes(limit=3)

    class Ep:
        def __init__(self, name: str) -> None:
            self.name = name

    for i in range(5):
        homes.note(f"r{i}", Ep(f"e{i}"))  # type: ignore[arg-type]
    assert [homes.get(f"r{i}") for i in range(5)] == [None, None, "e2", "e3", "e4"]


# -- through a gateway -------------------------------------------------------------------------
def _engine(tmp: Path, name: str) -> Proc:
    port = free_port()
    argv = [sys.executable, str(HERE / "responses_engine.py"), str(port), name]
    return Proc(argv, port, tmp / f"resp-{name}-{port}.log").start()


@pytest.fixture
def two(tmp_path: Path) -> Iterator[tuple[Proc, Proc, Proc]]:
    a, b = _engine(tmp_path, "a"), _engine(tmp_path, "b")
    cfg = tmp_path / "gw.json"
    cfg.write_text(
        json.dumps(
            {
                "tenants": [
                    {
                        "name": "tok",
                        "api_keys": [key_digest(KEY)],
                        "limits": {"completion_tokens_per_minute": 45},
                    },
                    {"name": "free", "api_keys": [key_digest(FREE)], "manage_adapters": True},
                ],
                "routing": "round_robin",
                "endpoint_header": True,
            }
        )
    )
    g = gateway(tmp_path, a.url, b.url, args=("--config", str(cfg)))
    try:
        yield a, b, g
    finally:
        for p in (g, a, b):
            p.stop()


def _post(g: Proc, path: str, body: dict[str, object], key: str = FREE) -> httpx.Response:
    return httpx.post(
        g.url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30
    )


def test_stored_responses_follow_their_replica(two: tuple[Proc, Proc, Proc]) -> None:
    """Round robin would send every second turn to the replica that never saw the previous
    one (vLLM: 404); the gateway sends a follow-up, a GET by id and a cancel where the
    response lives, whichever replica it is."""
    _, _, g = two
    first = _post(g, "/v1/responses", {"model": "resp-model", "input": "hi"})
    assert first.status_code == 200, first.text
    rid, home = first.json()["id"], first.headers["x-unbroken-endpoint"]
    prev = rid
    for _ in range(4):  # each turn continues the one before
        r = _post(g, "/v1/responses", {"input": "more", "previous_response_id": prev})
        assert r.status_code == 200, r.text
        assert r.headers["x-unbroken-endpoint"] == home
        prev = r.json()["id"]
    got = httpx.get(g.url + f"/v1/responses/{rid}", headers={"Authorization": f"Bearer {FREE}"})
    assert got.status_code == 200 and got.json()["id"] == rid
    cancel = _post(g, f"/v1/responses/{rid}/cancel", {})
    assert cancel.status_code == 400  # found (a finished response cannot be cancelled)
    missing = httpx.get(
        g.url + "/v1/responses/resp_nope",
        headers={"Authorization": f"Bearer {FREE}", "X-Request-ID": "mine-1"},
    )
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "Response with id 'resp_nope' not found."
    assert missing.headers["x-request-id"] == "mine-1"  # echoed on every answer


def test_responses_usage_counts_against_token_limits(two: tuple[Proc, Proc, Proc]) -> None:
    """Each answer reports 10 output tokens (`output_tokens`, not `completion_tokens`):
    45 a minute takes 5 requests (the fifth starts under the limit), streamed or not, then
    429; the tenant's token counter shows them."""
    _, _, g = two
    codes = []
    for i in range(6):
        r = _post(
            g, "/v1/responses", {"model": "resp-model", "input": "x", "stream": i % 2 == 1}, KEY
        )
        codes.append(r.status_code)
        if r.status_code == 200 and i % 2 == 1:  # a stream, buffered by no proxy in between
            assert r.headers["x-accel-buffering"] == "no"
        if r.status_code == 200:
            r.read()
    assert codes == [200, 200, 200, 200, 200, 429], codes
    assert (
        metric(g.url, "unbroken_gateway_tenant_tokens_total", tenant="tok", kind="completion") == 50
    )


def test_lora_adapters_load_on_every_replica(two: tuple[Proc, Proc, Proc]) -> None:
    a, b, g = two
    r = _post(g, "/v1/load_lora_adapter", {"lora_name": "ad1", "lora_path": "/x"})
    assert r.status_code == 200 and "added successfully" in r.text, r.text
    for e in (a, b):
        ids = [m["id"] for m in httpx.get(e.url + "/v1/models").json()["data"]]
        assert "ad1" in ids
    ids = [m.id for m in openai.OpenAI(base_url=g.url + "/v1", api_key=KEY).models.list()]
    assert "ad1" in ids
    # Routable at once (the models were read again before the answer), not at the next probe.
    eps = admin(g, "GET", "/admin/endpoints").json()["endpoints"]
    assert all("ad1" in e["models"] for e in eps), eps
    again = _post(g, "/v1/load_lora_adapter", {"lora_name": "ad1", "lora_path": "/x"})
    assert again.status_code == 400 and "already been loaded" in again.text
    unknown = _post(g, "/v1/load_lora_adapter", {"lora_name": "z", "lora_path": "/x", "model": "m"})
    assert unknown.status_code == 404


def test_ping_and_auth_before_routing(two: tuple[Proc, Proc, Proc]) -> None:
    _, _, g = two
    assert httpx.get(g.url + "/ping").status_code == 200
    assert httpx.post(g.url + "/ping").status_code == 200
    # Every answer echoes the request's id, these routes' too.
    for method, path in (("GET", "/ping"), ("GET", "/v1/models"), ("GET", "/nowhere")):
        r = httpx.request(
            method,
            g.url + path,
            headers={"Authorization": f"Bearer {FREE}", "X-Request-ID": "mine-2"},
        )
        assert r.headers["x-request-id"] == "mine-2", (path, r.headers)
    bad = {"Authorization": "Bearer wrong"}
    for method, path in (("GET", "/v1/nothing"), ("GET", "/v1/completions")):
        r = httpx.request(method, g.url + path, headers=bad)
        assert r.status_code == 401, (method, path, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"
    good = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(g.url + "/v1/nothing", headers=good).status_code == 404
    assert httpx.get(g.url + "/v1/completions", headers=good).status_code == 405
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=g.url + "/v1", api_key="wrong", max_retries=0).models.retrieve("x")


def test_a_conversation_on_simulators_stays_where_its_turns_are(tmp_path: Path) -> None:
    """Two simulators with vLLM's Responses store on, round robin: every turn of a
    conversation (`previous_response_id`) is served, by the replica that holds the one
    before, and its text is the one the engine gives for the whole conversation."""
    store = {"VLLM_ENABLE_RESPONSES_API_STORE": "1"}
    a = engine(tmp_path, name="a", env=store)
    b = engine(tmp_path, name="b", env=store)
    g = gateway(tmp_path, a.url, b.url, args=("--routing", "round_robin"))
    try:
        client = openai.OpenAI(base_url=g.url + "/v1", api_key="none", max_retries=0)
        first = client.responses.with_raw_response.create(
            model=MODEL, input="tell me about rivers", max_output_tokens=8
        )
        home = first.headers["x-unbroken-endpoint"]
        prev = first.parse()
        for turn in ("and lakes", "and the sea"):
            raw = client.responses.with_raw_response.create(
                model=MODEL, input=turn, previous_response_id=prev.id, max_output_tokens=8
            )
            assert raw.headers["x-unbroken-endpoint"] == home
            prev = raw.parse()
            assert prev.status == "incomplete" and prev.output_text  # 8 tokens, as asked
        again = client.responses.retrieve(prev.id)
        assert again.output_text == prev.output_text
    finally:
        for p in (g, a, b):
            p.stop()


def test_anthropic_messages_pass_through_and_route_by_prefix(tmp_path: Path) -> None:
    """vLLM 0.32 serves Anthropic's Messages API (Claude Code pointed at vLLM); through the
    gateway it was a 404. Now it passes (its event stream byte for byte), with
    `count_tokens`, and routes by prefix as chat: an agent's turns, each carrying the
    whole conversation (a long system prompt, tool calls and their results), stay on one
    replica, where the earlier turns' KV cache is."""
    a, b = _engine(tmp_path, "a"), _engine(tmp_path, "b")
    g = gateway(tmp_path, a.url, b.url)  # the default routing: prefix
    try:
        system = [{"type": "text", "text": "You are a careful coding agent. " * 60}]
        msgs: list[dict[str, object]] = [{"role": "user", "content": "list the files"}]
        homes = set()
        for turn in range(4):
            body = {"model": "resp-model", "max_tokens": 64, "system": system, "messages": msgs}
            r = httpx.post(g.url + "/v1/messages", json=body, timeout=30)
            assert r.status_code == 200, r.text
            assert r.json()["type"] == "message"
            home = r.headers["x-unbroken-endpoint"]
            assert r.json()["content"][0]["text"] == ("a" if home.endswith(str(a.port)) else "b")
            homes.add(home)
            call = {"type": "tool_use", "id": f"t{turn}", "name": "ls", "input": {"d": turn}}
            result = {"type": "tool_result", "tool_use_id": f"t{turn}", "content": "x.py " * 40}
            msgs = [
                *msgs,
                {"role": "assistant", "content": [call]},
                {"role": "user", "content": [result]},
            ]
        assert len(homes) == 1, homes
        # Streamed: Anthropic's named events, relayed as the engine sent them.
        body = {"model": "resp-model", "max_tokens": 8, "stream": True, "messages": msgs[:1]}
        with httpx.stream("POST", g.url + "/v1/messages", json=body, timeout=30) as r:
            assert r.status_code == 200
            text = r.read().decode()
        kinds = [ln.removeprefix("event: ") for ln in text.splitlines() if ln.startswith("event:")]
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
        r = httpx.post(g.url + "/v1/messages/count_tokens", json=body, timeout=30)
        assert r.status_code == 200 and r.json() == {"input_tokens": 7}
    finally:
        for p in (g, a, b):
            p.stop()


def test_an_anthropic_conversation_names_blocks_as_chat_does() -> None:
    """`messages_as_chat`: the same conversation sent as Anthropic's Messages and as chat
    names the same prefix blocks (so either reuses the other's cache routing); tool calls,
    tool results and images count; malformed shapes give a hint, never an exception."""
    from unbroken.gateway._prefix import hint_of, messages_as_chat

    system = "You are terse. " * 20
    anthropic = {
        "system": [{"type": "text", "text": system}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "metadata": {"user_id": "u-1"},
    }
    chat = {
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": "hi"},
        ]
    }
    a = hint_of(messages_as_chat(anthropic), True, "m", block_chars=16, session=None)
    c = hint_of(chat, True, "m", block_chars=16, session=None)
    assert list(a.blocks) == list(c.blocks) and a.session == "u-1"
    image = {"type": "image", "source": {"type": "base64", "data": "AAAA"}}
    other = {"type": "image", "source": {"type": "base64", "data": "BBBB"}}
    call = {"type": "tool_use", "name": "ls", "input": {"d": 1}}
    hints = [
        hint_of(
            messages_as_chat({"messages": [{"role": "user", "content": [block, "end" * 8]}]}),
            True,
            "m",
            block_chars=8,  # (only whole blocks are named)
            session=None,
        )
        for block in (image, other, call)
    ]
    assert len({tuple(h.blocks) for h in hints}) == 3  # each block tells them apart
    for bad in ({"messages": 5}, {"messages": "x", "system": 3}, {"messages": [None, 1]},
                {"messages": [{"role": "user", "content": [{"type": "tool_result",
                                                             "content": 7}]}]}):  # fmt: skip
        hint_of(messages_as_chat(bad), True, "m", block_chars=16, session=None)
