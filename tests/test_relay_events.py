"""The event transform's fast path (`Transform._fast`) against its general path
(`Transform._event`), in process (the transform is pure: no I/O, no loop): for every shape
of chunk an engine sends, both must leave the same bytes for the client and the same
accounting (tokens, token ids, text, finish) that a continuation is built from. The fast
path exists only for speed; any difference is a bug."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.gateway._transform import Transform
from unbroken.wire.sse import SSEDecoder, SSEEvent


def _relay(chat: bool, augmented: bool, wants: tuple[bool, bool, bool]) -> Transform:
    x = Transform(chat, augmented=augmented, wants=wants)
    x.new_leg(rewrite=False)
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
    fast = r_fast._fast(ev)
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
    a, b = _relay(chat, augmented, wants), _relay(chat, augmented, wants)
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
    assert r._fast(_event(obj)) is None
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
