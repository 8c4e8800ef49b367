"""What a stream does when a leg breaks (`BreakingRelay`, a layer of `_stream.StreamRelay`):
put the break on the endpoint's record and warn the endpoint's other streams when the engine
looks like it is going away; plan the next leg's continuation (token ids or text, split
outside a character) and open it on another endpoint; or, when the stream cannot be
continued, end it with an error event the client sees. None of this runs per chunk.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Self

import orjson
from aiohttp import web

from unbroken.gateway._continuation import (
    NotExact,
    augment,
    continuation_body,
    not_migratable,
    token_continuation_body,
)
from unbroken.gateway._pool import Endpoint
from unbroken.gateway._relay import ClientGone, SlowClient
from unbroken.gateway._stream_state import RelayState
from unbroken.gateway._upstream import Form, Leg, Retry, UpstreamResponse
from unbroken.wire.sse import encode_data, encode_json

__all__ = ["HANDOVER", "BreakingRelay"]

log = logging.getLogger("unbroken.gateway")

# At most this many tokens are given back to land a split outside a character (UTF-8: 4).
_MAX_SPLIT_BACK = 8
# Breaks that say the engine process is going away (not just this request failing).
_DYING = ("reset", "truncated", "abort")
# The break a worker makes to hand a stream to another process at a reload (`_handover`): not
# the endpoint's failure, and not a migration (no limit, not counted as one).
HANDOVER = "handover"


class BreakingRelay(RelayState):
    """A stream's breaks and continuations (module doc)."""

    __slots__ = ()

    if TYPE_CHECKING:

        async def _pump(self, up: UpstreamResponse, ep: Endpoint, n: int) -> str | None:
            """One leg's read loop: `_stream.StreamRelay._pump`."""

    # -- the stream -----------------------------------------------------------------------
    async def run(
        self: Self, up: UpstreamResponse | None, ep: Endpoint | None, n: int = 1
    ) -> web.StreamResponse:
        """Relay leg 0 (whose `n` slots on `ep` the caller has taken) and whatever follows.
        Raises Retry when leg 0 breaks before anything reached the client. `up` None: a
        stream handed over by another process (`resume`)."""
        m = self.p.metrics
        x = self.x
        try:
            if up is None:
                reason: str | None = HANDOVER
            else:
                assert ep is not None
                reason = await self._leg(up, ep, n, rewrite=False)
                if reason is not None and self.sink is None:
                    raise Retry(reason, f"stream from {ep.name} broke before its first event")
            while reason is not None:
                moved = reason == HANDOVER  # the endpoint did nothing wrong
                if moved and self._handoff is not None:
                    transfer, self._handoff = self._handoff, None
                    if await transfer(self):
                        return self._response()  # the connection lives on elsewhere
                if not moved:
                    assert self.ep is not None
                    self.failed.append(self.ep)
                tokens = self.x.token_path()
                why = not_migratable(self.raw, self.chat, tokens=tokens)
                if why is None and not moved and self.migrations >= self.p.cfg.max_migrations:
                    why = "migration_limit"
                if why is not None:
                    await self._give_up(reason, why)
                    return self._response()
                if tokens:
                    await self._safe_split()
                try:
                    tries = self._continuations(tokens)
                except NotExact as e:
                    await self._give_up(reason, str(e))
                    return self._response()
                if not moved:
                    self.migrations += 1
                    m.migrated.labels(reason).inc()
                if not tries:  # every token was delivered; only the finish was lost
                    await self._send(self.x.finish_chunk())
                    if x.want_usage and x.exact and x.prompt_tokens is not None:
                        await self._send(x.usage_chunk())
                    await self._send(encode_data(b"[DONE]"))
                    break
                leg = await self._open(tries)
                if leg is None:
                    await self._give_up(reason, "no_endpoint")
                    return self._response()
                up, ep, n, kind = leg.up, leg.ep, leg.n, leg.kind
                m.migration_path.labels(kind).inc()
                log.info(
                    "stream %s: %s on %s, continued on %s after %d tokens (%s path, %d back)",
                    self.x.tracker.id,
                    reason,
                    self.ep.name if self.ep is not None else "another worker",
                    ep.name,
                    self.sent,
                    kind,
                    x.split_back,
                )
                if kind == "text":
                    x.ids_ok = False  # later ids would follow a re-tokenized prompt
                self.interrupted = None
                x.tracker.error = None  # handled: this leg replaces the one that failed
                wrap = self.chat and kind == "tokens"
                reason = await self._leg(up, ep, n, rewrite=True, wrap_chat=wrap)
            assert self.sink is not None
            tail, self._tail = self._tail, b""
            await self.sink.finish(tail)
        except ClientGone:
            m.client_disconnects.inc()
        except SlowClient:
            m.slow_clients.inc()
            log.warning("stream %s ended for a slow client", self.x.tracker.id)
            if self.sink is not None:
                self.sink.abort()
        except asyncio.CancelledError:
            m.client_disconnects.inc()
            if self.sink is not None:
                self.sink.abort()
            raise
        finally:
            self._handoff = None
            if self.sink is not None:
                self.p.drop_sink(self.sink)
        return self._response()

    async def _safe_split(self) -> None:
        """Never continue from inside a character. The engine holds back text while its
        decoding ends in an incomplete (or not yet resolved) UTF-8 sequence, so the client
        has none of those last tokens' text; and vLLM, primed with a prompt whose decoding
        ends so, re-emits the whole prompt's text (measured). So the split moves back to the
        last token after which the text was whole (asked of an engine's /detokenize); the
        engine regenerates the dropped tokens, greedy, the same."""
        assert self.x.prompt_ids is not None
        for _ in range(_MAX_SPLIT_BACK):
            if not self.x.gen_ids:
                return
            text = await self.p.detokenize(
                self.model, self.x.prompt_ids + self.x.gen_ids, self.failed, self.headers
            )
            if not isinstance(text, str) or not text.endswith("\ufffd"):
                return
            self.x.gen_ids.pop()
            self.x.sent -= 1
            self.x.split_back += 1

    def _continuations(self, tokens: bool) -> list[Form]:
        """The forms of the next leg, to try in order on the next endpoint; empty when the
        token budget is spent."""
        out: list[Form] = []
        if tokens:
            assert self.x.prompt_ids is not None
            b = token_continuation_body(
                self.raw, self.chat, self.x.prompt_ids + self.x.gen_ids, self.x.sent
            )
            if b is None:
                return []
            out.append(Form("tokens", "/v1/completions", orjson.dumps(augment(b))))
        try:
            b = continuation_body(self.raw, self.chat, self.x.tracker.text(0), self.x.sent)
        except NotExact:
            if not out:
                raise
            return out  # the token path alone
        if b is None:
            return []
        if tokens and not_migratable(self.raw, self.chat) is not None:
            return out  # a token-id prompt, or other forms only the token path continues
        out.append(Form("text", self.path, orjson.dumps(augment(b) if self.x.augmented else b)))
        return out

    async def _open(self, forms: list[Form]) -> Leg | None:
        """The next leg on another endpoint, or None when none could take it."""
        p = self.p
        for _ in range(p.cfg.max_attempts):
            if not p.could_serve(self.model, self.priority, self.failed):
                return None
            try:
                leg = await p.open_upstream(
                    self.model,
                    self.priority,
                    forms,
                    self.failed,
                    limit=p.ttfb_limit,
                    weight=self.weight,
                    headers=self.headers,
                    hint=self.hint,
                )
            except Retry:
                continue
            if leg.up.status == 200:
                return leg
            detail = (leg.data or b"")[:300].decode(errors="replace")
            if leg.up.status >= 500:
                p.upstream_failed(leg.ep, f"status_{leg.up.status}", f"continuation: {detail}")
            else:
                log.info(
                    "%s refused every form of continuation: HTTP %d %s",
                    leg.ep.name,
                    leg.up.status,
                    detail,
                )
            self.failed.append(leg.ep)
            p.release(leg.ep, leg.n)
        return None

    async def _leg(
        self, up: UpstreamResponse, ep: Endpoint, n: int, *, rewrite: bool, wrap_chat: bool = False
    ) -> str | None:
        """One leg, and the one place its failure is put on the endpoint's record (a break
        we caused ourselves, the drain deadline, is not the endpoint's failure)."""
        self.x.new_leg(rewrite=rewrite, wrap_chat=wrap_chat, fingerprint=ep.fingerprint)
        reason = await self._pump(up, ep, n)
        if self.x.seen_fingerprint is not None:  # the engine's now (restarted, upgraded)
            ep.fingerprint = self.x.seen_fingerprint
        if reason is not None and reason != self.interrupted:
            self.p.upstream_failed(ep, reason, self.x.detail or f"stream {reason}")
            if reason in _DYING:
                self._alert_siblings(ep)
        return reason

    def _alert_siblings(self, ep: Endpoint) -> None:
        """A stream of `ep` just died: the engine may be going away. Its other streams get a
        short stall limit from their last event, so a connection the dying server holds open
        without events is migrated in about a second, not after `stall_timeout_s`."""
        for r in list(ep.relays):
            if r is not self:
                r.alert()

    async def _give_up(self, reason: str, why: str) -> None:
        """End the stream explicitly: an error event the client can see, then [DONE]."""
        m = self.p.metrics
        pool = self.failed[-1].pool if self.failed else "none"
        m.dropped.labels(pool, reason).inc()
        m.unmigratable.labels(why).inc()
        log.warning(
            "stream %s broke (%s) and cannot be continued (%s)", self.x.tracker.id, reason, why
        )
        err = self.x.tracker.error or {
            "message": f"the upstream stream broke ({reason}) and cannot be continued "
            f"elsewhere ({why})",
            "type": "upstream_error",
            "param": None,
            "code": "stream_broken",
        }
        await self._send(encode_json({"error": err}))
        await self._send(encode_data(b"[DONE]"))
        assert self.sink is not None
        await self.sink.finish()
