"""The event transform's fast path (`Transform._fast`) against its general path
(`Transform._event`), in process (the transform is pure: no I/O, no loop): for every shape
of chunk an engine sends, both must leave the same bytes for the client and the same
accounting (tokens, token ids, text, finish) that a continuation is built from. The fast
path exists only for speed; any difference is a bug."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.gateway._transform import Transform
from unbroken.wire.sse import SSEDecoder, SSEEvent


def _relay(
    chat: bool, augmented: bool, wants: tuple[bool, bool, bool], fp: str | None = None
) -> Transform:
    x = Transform(chat, augmented=augmented, wants=wants)
    x.new_leg(rewrite=False, fingerprint=fp)
    return x


def _state(r: Transform) -> dict[str, Any]:
    t = r.tracker
    return {
        "sent": r.sent,
        "leg_count": r.leg_count,
        "exact": r.exact,
        "ids_ok": r.ids_ok,
        "gen_ids": list(r.gen_ids),
        "prompt_tokens": r.prompt_tokens,
        "id": (t.id, t.created, t.model),
        "texts": {k: "".join(v) for k, v in t.texts.items()},
        "finish": dict(t.finish),
        "role": set(t.role_sent),
        "token_events": t.token_events,
    }


def _fast(x: Transform, ev: SSEEvent) -> Any:
    assert ev.plain and ev.data is not None
    return x._fast(ev.raw, ev.data)


def _event(obj: dict[str, Any]) -> SSEEvent:
    (ev,) = SSEDecoder().feed(b"data: " + orjson.dumps(obj) + b"\n\n")
    return ev


def _chunk(
    chat: bool, i: int, text: str | None, ids: bool, usage: bool, finish: str | None, role: bool
) -> dict[str, Any]:
    if chat:
        delta: dict[str, Any] = {} if text is None else {"content": text}
        if role:
            delta = {"role": "assistant", **delta}
        ch: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None}
    else:
        ch = {"index": 0, "text": text or "", "logprobs": None}
    ch["finish_reason"] = finish
    ch["stop_reason"] = None
    if ids:
        ch["token_ids"] = [100 + i]
    obj: dict[str, Any] = {
        "id": "cmpl-1",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": 7,
        "model": "m",
        "choices": [ch],
    }
    if usage:
        obj["usage"] = {"prompt_tokens": 5, "completion_tokens": i + 1, "total_tokens": 6 + i}
    return obj


def _both(r_fast: Transform, r_slow: Transform, ev: SSEEvent) -> tuple[Any, Any]:
    fast = _fast(r_fast, ev)
    out: list[bytes] = []
    verdict, n = r_slow._event(ev, False, out)
    assert verdict is None
    return fast, (n, out[0] if out else None)


@settings(max_examples=300, deadline=None)
@given(
    chat=st.booleans(),
    augmented=st.booleans(),
    wants=st.tuples(st.booleans(), st.booleans(), st.booleans()),
    steps=st.lists(
        st.tuples(
            st.one_of(st.none(), st.text(max_size=4)),  # text
            st.booleans(),  # token ids
            st.booleans(),  # usage
            st.sampled_from([None, None, None, "length", "stop"]),
            st.booleans(),  # role (chat)
        ),
        min_size=1,
        max_size=8,
    ),
)
def test_fast_path_equals_general_path(
    chat: bool,
    augmented: bool,
    wants: tuple[bool, bool, bool],
    steps: list[tuple[str | None, bool, bool, str | None, bool]],
) -> None:
    # With an endpoint's fingerprint: both paths stamp the same finishing chunks.
    a, b = _relay(chat, augmented, wants, "fp-1"), _relay(chat, augmented, wants, "fp-1")
    for i, (text, ids, usage, finish, role) in enumerate(steps):
        ev = _event(_chunk(chat, i, text, ids, usage, finish, role))
        fast, slow = _both(a, b, ev)
        assert fast is not None, "a one-choice chunk must take the fast path"
        assert fast[0] == slow[0]
        assert (fast[1] is None) == (slow[1] is None)
        if fast[1] is not None:
            assert orjson.loads(fast[1][6:]) == orjson.loads(slow[1][6:])
        assert _state(a) == _state(b)


@pytest.mark.parametrize(
    "obj",
    [
        {"choices": [{"index": 0, "text": "a", "finish_reason": "abort"}]},  # vLLM's abort
        {"error": {"message": "x"}},
        {"choices": [{"index": 0, "text": "a"}, {"index": 1, "text": "b"}]},  # n > 1
        {"choices": [{"index": 0, "text": "a", "prompt_token_ids": [1, 2]}]},  # first chunk
        {"prompt_token_ids": [1, 2], "choices": [{"index": 0, "text": "a"}]},
        {"choices": [{"index": 0, "text": 5}]},  # not a chunk
        {"choices": []},  # the usage-only last chunk
        {"choices": "x"},
    ],
)
def test_fast_path_leaves_the_rest_to_the_general_path(obj: dict[str, Any]) -> None:
    r = _relay(False, True, (False, False, False))
    assert _fast(r, _event(obj)) is None
    assert _state(r) == _state(_relay(False, True, (False, False, False)))


def test_decoder_fast_path_matches_the_general_decoder() -> None:
    """One plain event per read (the usual case) is cut without the buffer; anything else
    falls through, and both give the same events."""
    reads = [
        b'data: {"a":1}\n\n',
        b'data: {"a":2}\n\ndata: {"a":3}\n\n',
        b'data: {"a":4}\r\n\r\n',
        b'data: {"a"',
        b":5}\n\n",
        b"data: x\ndata: y\n\n",
    ]
    got = [(e.raw, e.data, e.plain) for chunk in reads for e in SSEDecoder().feed(chunk)]
    whole = SSEDecoder()
    joined = [(e.raw, e.data, e.plain) for chunk in reads for e in whole.feed(chunk)]
    assert [g[1] for g in joined] == [
        b'{"a":1}',
        b'{"a":2}',
        b'{"a":3}',
        b'{"a":4}',
        b'{"a":5}',
        b"x\ny",
    ]
    assert got[0] == (b'data: {"a":1}\n\n', b'{"a":1}', True)


def _raw_event(data: bytes) -> SSEEvent:
    (ev,) = SSEDecoder().feed(b"data: " + data + b"\n\n")
    return ev


_USAGE = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
_CH = {"index": 0, "text": "é", "finish_reason": None, "token_ids": [7, 8, 9]}


@pytest.mark.parametrize(
    "data",
    [
        # vLLM's layout: cut out of the bytes
        orjson.dumps({"id": "a", "choices": [_CH], "usage": _USAGE}),
        # other layouts: re-encoded by the general path, or cut where the layout allows
        orjson.dumps({"usage": _USAGE, "choices": [_CH]}),
        orjson.dumps({"choices": [{**_CH, "token_ids": [7, 8, 9], "x": 1}], "usage": _USAGE}),
        orjson.dumps({"choices": [_CH], "usage": {**_USAGE, "d": {"a": 1}}}),
        orjson.dumps({"choices": [_CH]}),
        orjson.dumps({"choices": [_CH], "x": [{"token_ids": [1]}], "usage": _USAGE}),
        json.dumps({"choices": [_CH], "usage": _USAGE}).encode(),  # spaces, \\u escapes
        json.dumps({"choices": [_CH], "usage": _USAGE}, separators=(",", ":")).encode(),
    ],
)
@pytest.mark.parametrize(
    "wants", [(False, False, False), (False, True, False), (True, False, True)]
)
def test_fast_path_strip_equals_general_path_on_any_layout(
    data: bytes, wants: tuple[bool, bool, bool]
) -> None:
    """What the client did not ask for is cut out of the engine's bytes only where the
    layout makes that exact; the client gets the same JSON either way."""
    a, b = _relay(False, True, wants), _relay(False, True, wants)
    ev = _raw_event(data)
    fast = _fast(a, ev)
    out: list[bytes] = []
    verdict, n = b._event(ev, False, out)
    assert verdict is None
    if fast is None:  # left to the general path: nothing accounted yet
        assert _state(a) == _state(_relay(False, True, wants))
        return
    assert fast[0] == n
    assert orjson.loads(fast[1][6:]) == orjson.loads(out[0][6:])
    assert _state(a) == _state(b)


def test_fast_path_takes_vllm_layout_and_cuts_bytes() -> None:
    """The usual augmented event is taken by the fast path without a re-encode: the bytes
    the client gets are the engine's, less usage and with the ids null."""
    data = orjson.dumps({"id": "a", "choices": [_CH], "usage": _USAGE})
    got = _fast(_relay(False, True, (False, False, False)), _raw_event(data))
    assert got is not None and got[0] == 3
    want = data.replace(b'"token_ids":[7,8,9]', b'"token_ids":null')
    assert got[1] == b"data: " + want[: want.index(b',"usage"')] + b"}\n\n"


@pytest.mark.parametrize(
    "data",
    [
        b'{"x":"\xff","choices":[{"index":0,"text":"a"}]}',  # not UTF-8 in a skipped field
        b'{"choices":[{"index":0,"text":"a"}]}x',
        b'{"choices":[{"index":0,"text":"a"}]',
    ],
)
def test_fast_path_refuses_what_the_general_path_refuses(data: bytes) -> None:
    r = _relay(False, True, (False, False, False))
    ev = _raw_event(data)
    assert _fast(r, ev) is None
    assert r._event(ev, False, [])[0] == "protocol"


@pytest.mark.parametrize("chat", [False, True])
def test_the_fingerprint_goes_where_vllm_puts_it(chat: bool) -> None:
    """Asked for usage, the engine put its fingerprint on the usage chunk: for a client that
    did not ask for usage the relay puts the endpoint's on each finishing chunk (either path,
    an event with CRLF endings too) and learns the engine's current one from that usage
    chunk; a chunk the gateway makes carries it as vLLM's would."""
    x = _relay(chat, True, (False, False, False), "fp-1")
    out: list[bytes] = []
    first = _chunk(chat, 0, "a", True, True, None, chat)
    last = _chunk(chat, 1, "b", True, True, "length", False)
    crlf = _chunk(chat, 1, "c", True, True, "stop", False)
    usage_only = {**_chunk(chat, 1, None, False, True, None, False), "choices": []}
    events = SSEDecoder().feed(
        b"".join(b"data: " + orjson.dumps(o) + b"\n\n" for o in (first, last))
        + b"data: "
        + orjson.dumps(crlf)
        + b"\r\n\r\n"
        + b"data: "
        + orjson.dumps({**usage_only, "system_fingerprint": "fp-2"})
        + b"\n\n"
    )
    x.take(events, out)
    objs = [orjson.loads(b[6:]) for b in out]
    assert [o.get("system_fingerprint") for o in objs] == [None, "fp-1", "fp-1"]
    assert list(objs[1])[-1] == "system_fingerprint"  # the last member, as vLLM writes it
    assert "usage" not in objs[1] and x.seen_fingerprint == "fp-2"
    assert orjson.loads(x.finish_chunk()[6:])["system_fingerprint"] == "fp-1"
    # A client that asked for usage: nothing stamped, the engine's usage chunk kept as sent;
    # the gateway's own usage chunk carries it.
    y = _relay(chat, True, (True, False, False), "fp-1")
    out = []
    y.take(SSEDecoder().feed(b"data: " + orjson.dumps(last) + b"\n\n"), out)
    assert "system_fingerprint" not in orjson.loads(out[0][6:])
    y.prompt_tokens = 5
    assert orjson.loads(y.usage_chunk()[6:])["system_fingerprint"] == "fp-1"
    # Not augmented (the engine got the client's own options): the engine's placement.
    z = _relay(chat, False, (False, False, False), "fp-1")
    out = []
    z.take(SSEDecoder().feed(b"data: " + orjson.dumps(last) + b"\n\n"), out)
    assert "system_fingerprint" not in orjson.loads(out[0][6:])


def test_a_chat_continued_on_the_token_path_keeps_the_fingerprint() -> None:
    from unbroken.gateway._transform_shape import _as_chat

    obj = {**_chunk(False, 1, None, False, True, None, False), "choices": []}
    assert _as_chat({**obj, "system_fingerprint": "fp"})["system_fingerprint"] == "fp"
