"""What a stream's events become for its client, and what a continuation is built from.

Pure: no I/O, no clock, no metrics. A relay (`_stream.StreamRelay`) hands each upstream read's
events to `Transform.take` and writes what comes out; the transform counts tokens as the
engine does (usage on every chunk, or token ids), keeps the token ids and text so far, strips
what the gateway asked the engine for and the client did not (usage, token ids: see
`_continuation.augment`), and on a continuation leg (`rewrite`) makes each event look like the
original stream's: its id and created time, no second role chunk, usage added up over legs.
A token-path leg of a chat stream (`wrap_chat`) is a /v1/completions stream turned into chat
chunks here.

The usual event, one choice on a first leg, is accounted inline (`_fast`); everything else
goes through `_event`. `tests/test_relay_events.py` holds the two to the same result. The
fast path's msgspec structs and byte cutting are `_transform_fast`'s; the general path's
chunk-shape helpers (is it a chunk, has it text, a completions chunk as chat) are
`_transform_shape`'s.
"""

from __future__ import annotations

from typing import Any

import msgspec
import orjson
from msgspec import UNSET

from unbroken.gateway._relay import StreamTracker
from unbroken.gateway._transform_fast import _CHAT, _TEXT, _raw, _strip
from unbroken.gateway._transform_fast import _IDS as _IDS
from unbroken.gateway._transform_fast import _USAGE as _USAGE
from unbroken.gateway._transform_fast import _ChatChoice as _ChatChoice
from unbroken.gateway._transform_fast import _ChatChunk as _ChatChunk
from unbroken.gateway._transform_fast import _Delta as _Delta
from unbroken.gateway._transform_fast import _TextChoice as _TextChoice
from unbroken.gateway._transform_fast import _TextChunk as _TextChunk
from unbroken.gateway._transform_fast import _Usage as _Usage
from unbroken.gateway._transform_shape import _as_chat, _has_text, _is_chunk
from unbroken.wire.sse import SSEEvent, encode_json

# `PROTOCOL` and `Transform` are this module's; the msgspec structs, `_strip`, `_raw` (now
# `_transform_fast`) and `_has_text`, `_is_chunk` (now `_transform_shape`) were defined here
# before the split (issue 22) and are still importable from here.
__all__ = ["PROTOCOL", "Transform"]

# The break of a leg whose engine violated the protocol (not SSE, an event that is not a
# completion chunk, an event past the size bound): none of its bytes reach the client.
PROTOCOL = "protocol"
_COMMENT = b": \n\n"  # an upstream comment (keep-alive), forwarded without its text


class Transform:
    """One client stream's event transform and accounting, across all its legs."""

    __slots__ = (
        "augmented",
        "chat",
        "detail",
        "exact",
        "gen_ids",
        "ids_ok",
        "leg_base",
        "leg_count",
        "leg_fingerprint",
        "legs",
        "plain_leg",
        "prompt_ids",
        "prompt_tokens",
        "rewrite",
        "seen_fingerprint",
        "sent",
        "split_back",
        "stamps",
        "tracker",
        "want_cont",
        "want_ids",
        "want_usage",
        "wrap_chat",
    )

    def __init__(self, chat: bool, *, augmented: bool, wants: tuple[bool, bool, bool]) -> None:
        self.chat = chat
        # Leg 0 went out with `augment`: what the client did not ask for is stripped here.
        self.augmented = augmented
        self.want_usage, self.want_cont, self.want_ids = wants
        self.tracker = StreamTracker(chat)
        # Tokens as the engine counts them (usage on every chunk, or token ids; events only
        # when an engine gives neither, `exact` then False).
        self.sent = 0
        self.leg_base = 0
        self.leg_count = 0
        self.exact = True
        self.prompt_tokens: int | None = None
        self.prompt_ids: list[int] | None = None
        self.gen_ids: list[int] = []
        self.ids_ok = True
        self.split_back = 0  # tokens regenerated to keep splits outside a character
        self.legs = 0
        self.rewrite = False  # this leg continues another: events are made the original's
        self.wrap_chat = False  # this leg is a token-path /v1/completions leg of a chat
        self.plain_leg = True  # neither: `_fast` may take its usual events
        self.detail: str | None = None  # why the leg broke, when the transform saw it
        # vLLM puts system_fingerprint on a finishing chunk only when no usage chunk follows;
        # asked for usage (`augment`), the engine put it on the usage chunk stripped here, so
        # a client who did not ask for usage gets the leg's engine's on its finishing chunks
        # (`_stamped`). A usage chunk the gateway makes carries it too. The one the engine's
        # own usage chunk carried goes back to its endpoint (an engine restarted or upgraded
        # behind the same address has another).
        self.stamps = augmented and not self.want_usage
        self.leg_fingerprint: str | None = None
        self.seen_fingerprint: str | None = None

    def new_leg(
        self, *, rewrite: bool, wrap_chat: bool = False, fingerprint: str | None = None
    ) -> None:
        """`fingerprint`: the leg's endpoint's (`Endpoint.fingerprint`)."""
        self.legs += 1
        self.leg_fingerprint = fingerprint
        self.seen_fingerprint = None
        self.leg_base, self.leg_count = self.sent, 0
        self.rewrite, self.wrap_chat = rewrite, wrap_chat
        self.plain_leg = not rewrite and not wrap_chat
        self.detail = None

    def take(self, events: list[SSEEvent], out: list[bytes]) -> tuple[int, str | None]:
        """A batch of events: what the client gets is appended to `out`; (tokens, verdict),
        the verdict "done" at a proper end, a reason at a break, None otherwise."""
        tokens = 0
        rewrite = self.rewrite
        fast = self.plain_leg
        for ev in events:
            if fast and ev.plain:
                got = self._fast(ev.raw, ev.data)  # type: ignore[arg-type]  # plain: data
                if got is not None:
                    tokens += got[0]
                    out.append(got[1])
                    continue
            verdict, n = self._event(ev, rewrite, out)
            tokens += n
            if verdict is not None:
                return tokens, verdict
        return tokens, None

    def _fast(self, raw: bytes, data: bytes) -> tuple[int, bytes] | None:
        """The usual event of a first leg, accounted as `_account` and `observe_obj` would:
        (tokens, bytes for the client), or None when `_event` must take
        it (not a one-choice chunk, prompt ids, an abort, an error, not JSON, a shape the
        typed decode refuses). Nothing is changed before it is known that this path takes
        the event.

        The event is decoded into a typed struct of the few fields the accounting reads
        (msgspec: the whole document is still parsed and validated, but no dict is built),
        and what the client did not ask for is cut out of the engine's own bytes
        (`_strip`) instead of a re-encode. `raw` is a plain event (`SSEEvent.plain`), `data`
        its data."""
        if data[:1] != b"{":
            return None
        try:
            obj = (_CHAT if self.chat else _TEXT).decode(data)
            if not data.isascii():
                data.decode()  # msgspec does not check UTF-8 in the fields it skips; orjson does
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError):
            return None
        if obj.error is not UNSET or obj.prompt_token_ids is not None:
            return None
        choices = obj.choices
        if choices is None or len(choices) != 1:
            return None
        ch = choices[0]
        if ch.index != 0 or ch.prompt_token_ids is not None:
            return None
        fr = ch.finish_reason
        if fr == "abort":
            return None
        role = False
        if self.chat:
            d = ch.delta
            if d is None:
                return None
            text = d.content
            role = d.role is not UNSET
        else:
            text = ch.text
        ids = ch.token_ids
        u = obj.usage
        if self.augmented:
            cut_ids = ids is not None and not self.want_ids
            cut_usage = u is not None and not self.want_cont
            if cut_ids or cut_usage:
                stripped = _strip(data, cut_ids, cut_usage)
                if stripped is None:
                    return None  # not laid out as vLLM lays it out: `_event` re-encodes
                raw = b"data: " + stripped + b"\n\n"
        # Taken: account (as `_count` and `observe_obj`).
        if u is not None and u.completion_tokens is not None:
            n = self._count_usage(u.completion_tokens, u.prompt_tokens, ids)
        else:
            n = self._count(None, ids, 1 if text else 0)
        tracker = self.tracker
        if role:
            tracker.role_sent.add(0)
        if tracker.id is None:
            tracker.id = _raw(obj.id)
            tracker.created = _raw(obj.created)
            tracker.model = _raw(obj.model)
        if text:
            t = tracker.texts.get(0)
            if t is None:
                tracker.texts[0] = [text]
            else:
                t.append(text)
            tracker.token_events += 1
        if fr:
            tracker.finish[0] = fr
            if self.stamps and self.leg_fingerprint is not None:
                raw = _stamped(raw, self.leg_fingerprint)
        return n, raw

    def _count_usage(self, ct: int, pt: int | None, ids: list[int] | None) -> int:
        """`_count` for an event whose usage carries an int `completion_tokens`."""
        n = ct - self.leg_count
        if n < 0:
            n = 0
        self.leg_count = ct
        if self.legs == 1 and self.prompt_tokens is None:
            self.prompt_tokens = pt
        if n:
            if ids is not None and len(ids) == n:
                self.gen_ids.extend(ids)
            else:
                self.ids_ok = False
        self.sent = self.leg_base + ct
        return n

    def _count(self, u: Any, ids: list[int] | None, text_events: int) -> int:
        """An event's tokens as the engine counts them: from its usage (cumulative per leg),
        else its token ids, else its events with text (`exact` then False); the ids kept
        while they account for every token."""
        if isinstance(u, dict) and isinstance(ct := u.get("completion_tokens"), int):
            n = max(0, ct - self.leg_count)
            self.leg_count = ct
            if self.legs == 1 and self.prompt_tokens is None:
                pt = u.get("prompt_tokens")
                self.prompt_tokens = pt if isinstance(pt, int) else None
        elif ids is not None:
            n = len(ids)
            self.leg_count += n
        else:
            n = text_events
            self.leg_count += n
            if n:
                self.exact = False  # events, not tokens: this engine gives no counts
        if n:
            if ids is not None and len(ids) == n:
                self.gen_ids.extend(ids)
            else:
                self.ids_ok = False
        self.sent = self.leg_base + self.leg_count
        return n

    def _event(self, ev: SSEEvent, rewrite: bool, out: list[bytes]) -> tuple[str | None, int]:
        """Any event, in full: (verdict or None, tokens); what the client gets goes to
        `out`."""
        tracker = self.tracker
        if ev.data is None:
            if ev.raw.startswith(b":"):
                out.append(_COMMENT)
            return None, 0  # `event:`, `id:`, `retry:` alone: nothing an OpenAI client reads
        if ev.is_done:
            if tracker.finished:
                tracker.done = True
                out.append(ev.raw)
                return "done", 0
            return "truncated", 0
        try:
            obj = orjson.loads(ev.data)
        except orjson.JSONDecodeError:
            obj = None
        if not isinstance(obj, dict) or not (
            "error" in obj or _is_chunk(obj, self.chat and not self.wrap_chat)
        ):
            # Not JSON, or not a completion chunk (events run together for want of the
            # blank line between them are this too): the leg is broken, its bytes dropped.
            self.detail = f"an event that is not a completion chunk: {ev.data[:120]!r}"
            return PROTOCOL, 0
        if "error" in obj:
            tracker.observe_obj(obj)
            return "error_event", 0
        if self.wrap_chat:
            obj = _as_chat(obj)
        n, aborted, changed = self._account(obj, rewrite)
        if aborted:
            # vLLM ended the request itself (shutdown): a break, not a finish. Its text
            # so far goes to the client; the rest comes from another engine.
            if n or _has_text(obj):
                raw = self._rewrite(obj) if rewrite else encode_json(obj)
                if raw is not None:
                    tracker.observe_obj(obj)
                    out.append(raw)
            return "abort", n
        if changed is None:  # a chunk only the gateway asked for
            return None, n
        raw = ev.raw
        if rewrite:
            r = self._rewrite(obj)
            if r is None:
                return None, n
            raw = r
        elif changed or not ev.plain:
            raw = encode_json(obj)
        if self.stamps and self.leg_fingerprint is not None and _finishing(obj):
            raw = _stamped(raw, self.leg_fingerprint)
        tracker.observe_obj(obj)
        out.append(raw)
        return None, n

    def _account(self, obj: dict[str, Any], rewrite: bool) -> tuple[int, bool, bool | None]:
        """Count the event's tokens as the engine does, note its token ids, take out what the
        client did not ask for. (tokens, aborted, changed); changed None: drop the event.
        One pass over the choices: this runs for every event relayed."""
        changed: bool | None = False
        aborted = False
        choices = obj.get("choices") or ()
        u = obj.get("usage")
        text_events = 0
        ids: list[int] | None = None
        first_leg = self.legs == 1
        strip = self.augmented or rewrite
        strip_prompt = rewrite or not self.want_ids
        for ch in choices:
            if not isinstance(ch, dict):
                continue
            if ch.get("finish_reason") == "abort":
                ch["finish_reason"] = None
                aborted = changed = True
            if ch.get("index", 0) == 0:
                t = ch.get("token_ids")
                if isinstance(t, list):
                    ids = t
                if first_leg and isinstance(pids := ch.get("prompt_token_ids"), list):
                    self.prompt_ids = pids
                txt = (ch.get("delta") or {}).get("content") if self.chat else ch.get("text")
                if txt:
                    text_events += 1
            if strip:
                # vLLM keeps these keys, null, when they were not asked for: so does the relay.
                if strip_prompt and ch.get("prompt_token_ids") is not None:
                    ch["prompt_token_ids"] = None
                    changed = True
                if not self.want_ids and ch.get("token_ids") is not None:
                    ch["token_ids"] = None
                    changed = True
        if first_leg and isinstance(pids := obj.get("prompt_token_ids"), list):
            self.prompt_ids = pids
        n = self._count(u, ids, text_events)
        if not choices and isinstance(fp := obj.get("system_fingerprint"), str):
            self.seen_fingerprint = fp  # the engine's usage chunk (vLLM's last)
        if strip:
            if strip_prompt and obj.get("prompt_token_ids") is not None:
                obj["prompt_token_ids"] = None
                changed = True
            if self.augmented and u is not None:
                if choices and not self.want_cont:
                    del obj["usage"]
                    changed = True
                elif not choices and not self.want_usage:
                    changed = None
        return n, aborted, changed

    def _rewrite(self, obj: dict[str, Any]) -> bytes | None:
        """An event of a continuation leg, as the original stream would have sent it."""
        t = self.tracker
        if t.id is not None:
            obj["id"] = t.id
            obj["created"] = t.created
        choices = obj.get("choices")
        if self.chat and choices:
            keep = []
            for ch in choices:
                d = ch.get("delta")
                if isinstance(d, dict) and "role" in d:
                    del d["role"]
                    if (
                        not d.get("content")
                        and not ch.get("finish_reason")
                        and not d.get("tool_calls")
                    ):
                        continue
                keep.append(ch)
            if not keep and not obj.get("usage"):
                return None
            obj["choices"] = keep
        u = obj.get("usage")
        if isinstance(u, dict) and isinstance(u.get("prompt_tokens"), int):
            # The client's usage: its own prompt, every token it was sent on every leg.
            b = self.leg_base
            pt = self.prompt_tokens if self.prompt_tokens is not None else u["prompt_tokens"] - b
            ct = (u.get("completion_tokens") or 0) + b
            obj["usage"] = {
                **u,
                "prompt_tokens": pt,
                "completion_tokens": ct,
                "total_tokens": pt + ct,
            }
        return encode_json(obj)

    def usage_chunk(self) -> bytes:
        t = self.tracker
        assert self.prompt_tokens is not None
        return encode_json(
            {
                "id": t.id,
                "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": t.created,
                "model": t.model,
                "choices": [],
                "usage": {
                    "prompt_tokens": self.prompt_tokens,
                    "total_tokens": self.prompt_tokens + self.sent,
                    "completion_tokens": self.sent,
                },
                **(
                    {}
                    if self.leg_fingerprint is None
                    else {"system_fingerprint": self.leg_fingerprint}
                ),
            }
        )

    def finish_chunk(self) -> bytes:
        t = self.tracker
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "delta": {},
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
            }
            kind = "chat.completion.chunk"
        else:
            choice = {
                "index": 0,
                "text": "",
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
            }
            kind = "text_completion"
        t.finish[0] = "length"
        raw = encode_json(
            {
                "id": t.id,
                "object": kind,
                "created": t.created,
                "model": t.model,
                "choices": [choice],
            }
        )
        fp = self.leg_fingerprint
        return _stamped(raw, fp) if self.stamps and fp is not None else raw

    def token_path(self) -> bool:
        """Can this stream continue from token ids (prompt ids and every generated id)?"""
        return (
            self.ids_ok
            and self.exact
            and self.prompt_ids is not None
            and len(self.gen_ids) == self.sent
        )


def _finishing(obj: dict[str, Any]) -> bool:
    """A chunk with a choice's finish (an abort is a break, its reason nulled by `_account`)."""
    return any(isinstance(ch, dict) and ch.get("finish_reason") for ch in obj.get("choices") or ())


_FP_KEY = b'"system_fingerprint":'


def _stamped(raw: bytes, fingerprint: str) -> bytes:
    """An event (`data: {...}` and its blank line) with `system_fingerprint` as its object's
    last member, as vLLM serialises it on a finishing chunk; unchanged when it has one (an
    engine that put it there itself) or is laid out otherwise. Once per choice a stream."""
    body = raw.rstrip(b"\r\n")
    if not body.endswith(b"}") or _FP_KEY in body:
        return raw
    return body[:-1] + b"," + _FP_KEY + orjson.dumps(fingerprint) + b"}" + raw[len(body) :]
