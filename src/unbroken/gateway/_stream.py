"""One client stream, relayed from one or more upstream legs.

Leg 0 is the original request. A leg whose first event does not come within the endpoint's
time-to-first-byte limit is cut; for leg 0 nothing has reached the client yet, so the request
is retried elsewhere. When a leg breaks after the client has received something
(connection reset, engine crash, no event for `stall_timeout_s`, an error event, a stream cut
short, or the drain deadline of its endpoint), the stream continues on another ready endpoint
(see `_continuation`) and the new leg is spliced in: same id and created time, no second role
chunk, usage added up, one finish. With greedy decoding the client receives exactly the text
an unbroken stream would have produced.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import orjson
from aiohttp import web

from unbroken.gateway._continuation import (
    NotExact,
    augment,
    continuation_body,
    not_migratable,
    token_continuation_body,
)
from unbroken.gateway._messages import SNAPSHOT_VERSION, StreamState
from unbroken.gateway._pool import Endpoint
from unbroken.gateway._prefix import RouteHint
from unbroken.gateway._relay import ClientGone, ClientSink, SlowClient, StreamTracker
from unbroken.gateway._transform import PROTOCOL, Transform
from unbroken.gateway._upstream import Form, Leg, Retry, UpstreamResponse
from unbroken.wire.http import SSE_HEADERS
from unbroken.wire.sse import (
    EventTooLarge,
    SSEDecoder,
    SSEEvent,
    encode_data,
    encode_json,
)

if TYPE_CHECKING:
    from unbroken.config.spec import GatewaySettings as GatewayConfig
    from unbroken.gateway._metrics import GatewayMetrics

__all__ = ["SNAPSHOT_VERSION", "RelayHost", "StreamRelay"]

log = logging.getLogger("unbroken.gateway")

# A leg learns its stall limit from its own gaps between events: STALL_FACTOR x the longest
# gap seen, once STALL_LEARN gaps are known, never below STALL_FLOOR_S nor above the
# configured `stall_timeout_s`. An endpoint on which another stream has just died, or that is
# out of rotation (its /health failing), is given
# less: SIBLING_FACTOR x the gap, at least SIBLING_FLOOR_S, from a stream's last event.
STALL_FACTOR = 8.0
STALL_LEARN = 8
STALL_FLOOR_S = 2.0
SIBLING_FACTOR = 4.0
SIBLING_FLOOR_S = 1.0
# At most this many tokens are given back to land a split outside a character (UTF-8: 4).
_MAX_SPLIT_BACK = 8
# Breaks that say the engine process is going away (not just this request failing).
_DYING = ("reset", "truncated", "abort")
# The break a worker makes to hand a stream to another process at a reload (`_handover`): not
# the endpoint's failure, and not a migration (no limit, not counted as one).
HANDOVER = "handover"


class RelayHost(Protocol):
    """What a relay needs of the gateway (the proxy is one): the seam to open upstream legs,
    the endpoints' records, and its client sinks."""

    cfg: GatewayConfig
    metrics: GatewayMetrics

    async def open_upstream(
        self,
        model: str,
        priority: str,
        forms: Sequence[Form],
        exclude: list[Endpoint],
        *,
        limit: Callable[[Endpoint], float],
        streaming: bool = True,
        weight: int = 1,
        size: int = 0,
        headers: dict[str, str],
        hint: RouteHint | None = None,
    ) -> Leg: ...
    def could_serve(self, model: str, priority: str, exclude: list[Endpoint]) -> bool: ...
    def release(self, ep: Endpoint, n: int = 1) -> None: ...
    def upstream_failed(self, ep: Endpoint, kind: str, detail: str) -> None: ...
    def ttfb_limit(self, ep: Endpoint) -> float: ...
    def observe_ttfb(self, ep: Endpoint, seconds: float) -> None: ...
    def watch_streams(self) -> None: ...
    def alive(self, ep: Endpoint) -> bool: ...
    def first_byte_patience(
        self, ep: Endpoint, start: float
    ) -> Callable[[float], float | None]: ...
    def response_headers(self, base: dict[str, str], ep: Endpoint | None) -> dict[str, str]: ...
    async def detokenize(
        self, model: str, ids: list[int], exclude: list[Endpoint], headers: dict[str, str]
    ) -> str | None: ...
    def stream_sink(self, request: web.Request, resp: web.StreamResponse) -> ClientSink: ...
    def drop_sink(self, sink: ClientSink) -> None: ...


class StreamRelay:
    """One client stream and its legs (module doc)."""

    __slots__ = (
        "__weakref__",  # `_handover` holds relays weakly
        "_dec",
        "_exc",
        "_first",
        "_gap_max",
        "_gaps",
        "_handoff",
        "_itl",
        "_last_event",
        "_last_token",
        "_loop",
        "_outq",
        "_raw",
        "_rearm_at",
        "_started",
        "_tmo",
        "_verdict",
        "_wake",
        "body",
        "chat",
        "ep",
        "failed",
        "headers",
        "hint",
        "interrupted",
        "migrations",
        "model",
        "p",
        "path",
        "priority",
        "request",
        "resp",
        "sink",
        "t0",
        "up",
        "weight",
        "x",
    )

    def __init__(
        self,
        proxy: RelayHost,
        request: web.Request,
        *,
        path: str,
        body: bytes,
        chat: bool,
        model: str,
        priority: str,
        headers: dict[str, str],
        t0: float,
        weight: int = 1,
        augmented: bool = False,
        wants: tuple[bool, bool, bool] = (False, False, False),
        hint: RouteHint | None = None,
    ) -> None:
        self.p = proxy
        self.hint = hint  # the prompt's block names: a continuation prefers who holds them
        self.request = request
        self.path = path
        self.body = body
        self._raw: dict[str, Any] | None = None
        self.weight = weight
        self.chat = chat
        self.model = model
        self.priority = priority
        self.headers = headers
        self.t0 = t0
        self.x = Transform(chat, augmented=augmented, wants=wants)
        self.resp: web.StreamResponse | None = None
        self.sink: ClientSink | None = None
        self.ep: Endpoint | None = None
        self.up: UpstreamResponse | None = None
        self.interrupted: str | None = None
        self.failed: list[Endpoint] = []
        self.migrations = 0
        self._tmo: asyncio.Timeout | None = None
        self._last_event = 0.0
        self._rearm_at = 0.0
        self._gaps = 0
        self._gap_max = 0.0
        self._last_token = 0.0
        self._itl: Any = None
        # One leg's read-callback state (see `_pump`).
        self._loop = asyncio.get_running_loop()
        self._wake: asyncio.Future[None] = self._loop.create_future()
        self._dec = SSEDecoder()
        self._first = True
        self._started = 0.0
        self._verdict: str | None = None
        self._exc: BaseException | None = None
        self._outq: list[bytes] = []
        # Set by `hand_over`: moves the stream to another process once its leg is cut.
        self._handoff: Callable[[StreamRelay], Awaitable[bool]] | None = None

    @property
    def raw(self) -> dict[str, Any]:
        """The request as a dict, parsed only when a migration needs it (a stream keeps its
        body's bytes, not a second, larger copy of it)."""
        if self._raw is None:
            self._raw = orjson.loads(self.body)
        return self._raw

    @property
    def tracker(self) -> StreamTracker:
        """What went through this stream so far (its transform's)."""
        return self.x.tracker

    @property
    def sent(self) -> int:
        """Tokens the client has, as the engine counts them."""
        return self.x.sent

    def token_path(self) -> bool:
        """Can this stream continue from token ids?"""
        return self.x.token_path()

    @property
    def last_event(self) -> float:
        """When this stream's current leg last got an event (loop time; 0 before any)."""
        return self._last_event

    # -- called by the gateway ------------------------------------------------------------
    def interrupt(self, reason: str) -> None:
        """Cut the current leg now (drain deadline); the stream continues elsewhere."""
        if self.interrupted is None:
            self.interrupted = reason
            if self.up is not None:
                self.up.close()
                self._end_leg("reset")

    def hand_over(self, transfer: Callable[[StreamRelay], Awaitable[bool]]) -> bool:
        """Cut the current leg between two events (the engine frees the request) so that
        `transfer` can move the stream, with its client connection, to another process
        (`_handover`, at a reload). `transfer` runs in this stream's task once everything
        relayed so far was handed to the client's sink; when it returns False the stream
        continues here, by continuation, as after any other break. False, and nothing done,
        when no leg is running or the client has not had the response's headers yet."""
        if self.interrupted is not None or self.up is None or self.sink is None:
            return False
        self._handoff = transfer
        self.interrupt(HANDOVER)
        return True

    def snapshot(self) -> StreamState:
        """What another process needs to carry this stream on (all but the body's bytes,
        which travel beside it; `_messages.StreamState`): see `restore`."""
        x = self.x
        t = x.tracker
        return {
            "path": self.path,
            "chat": self.chat,
            "model": self.model,
            "priority": self.priority,
            "headers": {str(k): str(v) for k, v in self.headers.items()},  # not istr keys
            "t0": self.t0,  # CLOCK_MONOTONIC: the same clock in every process of the host
            "weight": self.weight,
            "augmented": x.augmented,
            "wants": [x.want_usage, x.want_cont, x.want_ids],
            "migrations": self.migrations,
            "failed": [e.name for e in self.failed],
            "sent": x.sent,
            "exact": x.exact,
            "prompt_tokens": x.prompt_tokens,
            "prompt_ids": x.prompt_ids,
            "gen_ids": x.gen_ids,
            "ids_ok": x.ids_ok,
            "split_back": x.split_back,
            "legs": x.legs,
            "gaps": self._gaps,
            "gap_max": self._gap_max,
            "last_token": self._last_token,
            "pool": self.ep.pool if self.ep is not None else None,
            "tracker": {
                "id": t.id,
                "created": t.created,
                "model": t.model,
                "texts": {str(i): "".join(v) for i, v in t.texts.items()},
                "finish": {str(i): v for i, v in t.finish.items()},
                "role_sent": sorted(t.role_sent),
                "token_events": t.token_events,
            },
        }

    @classmethod
    def restore(cls, host: RelayHost, state: StreamState, body: bytes) -> StreamRelay:
        """A stream another process handed over (`snapshot`); `resume` continues it."""
        wants = state["wants"]
        r = cls(
            host,
            None,  # type: ignore[arg-type]  # no aiohttp request: the sink is the connection
            path=state["path"],
            body=body,
            chat=state["chat"],
            model=state["model"],
            priority=state["priority"],
            headers=state["headers"],
            t0=state["t0"],
            weight=state["weight"],
            augmented=state["augmented"],
            wants=(wants[0], wants[1], wants[2]),
        )
        r.migrations = state["migrations"]
        r.x.sent = state["sent"]
        r.x.exact = state["exact"]
        r.x.prompt_tokens = state["prompt_tokens"]
        r.x.prompt_ids = state["prompt_ids"]
        r.x.gen_ids = state["gen_ids"]
        r.x.ids_ok = state["ids_ok"]
        r.x.split_back = state["split_back"]
        r.x.legs = state["legs"]
        r._gaps, r._gap_max = state["gaps"], state["gap_max"]
        if state["last_token"] and state["pool"] is not None:
            r._last_token = state["last_token"]
            r._itl = host.metrics.for_pool(state["pool"])[1]
        tr, t = state["tracker"], r.x.tracker
        t.id, t.created, t.model = tr["id"], tr["created"], tr["model"]
        t.texts = {int(i): [v] for i, v in tr["texts"].items()}
        t.finish = {int(i): v for i, v in tr["finish"].items()}
        t.role_sent = set(tr["role_sent"])
        t.token_events = tr["token_events"]
        return r

    async def resume(self, sink: ClientSink) -> None:
        """Carry on a stream handed over by another process, writing to `sink` (its client's
        connection, adopted): its leg was cut there, so the next one starts at once, by
        continuation."""
        self.sink, self.resp = sink, sink.resp
        await self.run(None, None)

    # -- the stream -----------------------------------------------------------------------
    async def run(
        self, up: UpstreamResponse | None, ep: Endpoint | None, n: int = 1
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
            await self.sink.finish()
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

    def _response(self) -> web.StreamResponse:
        assert self.resp is not None
        return self.resp

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
        self.x.new_leg(rewrite=rewrite, wrap_chat=wrap_chat)
        reason = await self._pump(up, ep, n)
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

    def alert(self) -> None:
        """This leg's endpoint looks like it is dying (a sibling stream died, or it is out of
        rotation): a short stall limit from the last event. A leg that still gets events is
        not cut: its next event re-arms the normal limit."""
        if self._tmo is None or self._last_event == 0.0:
            return
        when = self._last_event + max(SIBLING_FLOOR_S, SIBLING_FACTOR * self._gap_max)
        cur = self._tmo.when()
        if cur is None or when < cur:
            self._tmo.reschedule(when)
            self._rearm_at = 0.0

    def _stall_limit(self) -> float:
        stall = self.p.cfg.stall_timeout_s
        if self._gaps < STALL_LEARN:
            return stall
        return min(stall, max(STALL_FLOOR_S, STALL_FACTOR * self._gap_max))

    async def _pump(self, up: UpstreamResponse, ep: Endpoint, n: int) -> str | None:
        """Pump one upstream leg into the client. None: the stream is complete; otherwise
        why the leg broke. Releases the leg's slots.

        The upstream's bytes are taken inside its read callback (`_on_body`): events are
        decoded, accounted and written to the client there, with no task switch per chunk.
        This task waits for the leg's end, and sends what the callback could not (the first
        write, which carries the response headers; a client aiohttp must frame itself)."""
        self.up, self.ep = up, ep
        ep.relays.add(self)
        self.p.watch_streams()
        loop = self._loop
        self._wake = loop.create_future()
        self._dec = SSEDecoder(self.p.cfg.max_sse_event_bytes)
        self._first = True
        self._started = loop.time()
        self._last_event = 0.0
        self._verdict = None
        self._exc = None
        self._outq = []
        decide = self._patience(ep)
        # Until the first event: the endpoint's time-to-first-byte limit; then the stall
        # limit, learned from this stream's own gaps. When it comes due, `decide` may give
        # the leg longer (the time limit is entered again; the leg goes on being read).
        deadline = self._started + self.p.ttfb_limit(ep)
        reading = False
        if up.content_type != "text/event-stream":
            # A 200 that is not a stream (an HTML error page, a JSON body): never relayed.
            reading = True
            self.x.detail = f"a streaming answer of type {up.content_type or 'none'!r}"
            self._verdict = PROTOCOL
        try:
            while True:
                waiting = False
                try:
                    async with asyncio.timeout_at(deadline) as tmo:
                        self._tmo = tmo
                        self._rearm_at = 0.0
                        if not reading:
                            reading = True
                            up.stream(self._on_body, self._on_end)
                        while True:
                            if self._outq:
                                out = b"".join(self._outq)
                                self._outq.clear()
                                await self._send(out)
                                continue
                            if self._exc is not None:
                                raise self._exc
                            if self._verdict is not None:
                                break
                            self._wake = loop.create_future()
                            waiting = True
                            await self._wake
                            waiting = False
                    break
                except TimeoutError:
                    # Only a limit that fell while idle is given longer (not one that cut a
                    # write to the client half way).
                    more = decide(loop.time()) if waiting and self._verdict is None else None
                    if more is None:
                        raise
                    deadline = more
            self._tmo = None  # left: an alert must not move it now
            verdict = self._verdict
            if verdict == "done":
                return None
            if verdict == "eof":
                if self.interrupted:
                    return self.interrupted
                if self.x.tracker.finished:  # finish seen, [DONE] lost: complete it
                    await self._send(encode_data(b"[DONE]"))
                    return None
                return "truncated"
            if verdict == "reset":
                return self.interrupted or "reset"
            return verdict
        except TimeoutError:
            return self.interrupted or ("ttfb" if self._first else "stall")
        finally:
            up.detach()
            self._tmo = None
            ep.relays.discard(self)
            self.up = None
            if self._verdict in ("done", "eof"):
                up.release()  # the connection is reused
            else:
                up.close()  # the engine sees the disconnect and frees the slot
            self.p.release(ep, n)

    def _patience(self, ep: Endpoint) -> Callable[[float], float | None]:
        """When this leg's time limit comes due: before its first event, the first-byte rule
        (`first_byte_patience`); after it, a stall on an endpoint whose other streams still
        get events, with no other endpoint to continue on, is waited out (a request the
        engine preempted, or an engine past saturation) up to `stall_timeout_s` from the last
        event, instead of being cut and then dropped for want of an endpoint."""
        first = self.p.first_byte_patience(ep, self._started)
        cfg = self.p.cfg

        def decide(now: float) -> float | None:
            if self._first:
                return first(now)
            ceiling = self._last_event + cfg.stall_timeout_s
            if (
                now < ceiling
                and self.interrupted is None
                and self.p.alive(ep)
                and not self.p.could_serve(self.model, self.priority, [*self.failed, ep])
            ):
                return min(ceiling, now + self._stall_limit())
            return None

        return decide

    # -- the read callback's side -----------------------------------------------------------
    def _wake_up(self) -> None:
        if not self._wake.done():
            self._wake.set_result(None)

    def _end_leg(self, verdict: str) -> None:
        if self._verdict is None:
            self._verdict = verdict
            if self.up is not None:
                self.up.detach()
        self._wake_up()

    def _on_body(self, chunk: bytes) -> None:
        dec = self._dec
        if self._last_token and self.x.plain_leg and self._verdict is None:
            data = dec.one(chunk)
            if data is not None:
                # The usual read: one plain token event of a first leg after its first
                # token, accounted, observed and written right here (a read's Python is most
                # of a chunk's CPU). Anything else goes through `_events`.
                self._clock()
                got = self.x._fast(chunk, data)
                if got is None:
                    self._forward([SSEEvent(chunk, data, True)])
                    return
                n, raw = got
                if n:
                    t = time.monotonic()
                    self._itl.observe(t - self._last_token)
                    if n > 1:
                        self._itl.observe_zeros(n - 1)
                    self._last_token = t
                sink = self.sink
                try:
                    if self._outq or sink is None or not sink.send_nowait(raw):
                        self._outq.append(raw)
                        self._wake_up()
                except (ClientGone, SlowClient) as e:
                    self._exc = e
                    self._end_leg("client")
                return
        try:
            events = dec.feed(chunk)
        except EventTooLarge as e:
            self.x.detail = str(e)
            self._end_leg(PROTOCOL)
            return
        if events:
            self._events(events)

    def _on_end(self, exc: BaseException | None) -> None:
        if exc is not None:
            self.x.detail = f"{type(exc).__name__}: {exc}"
            self._end_leg("reset")
            return
        tail = self._dec.flush()
        if tail:
            self._events(tail)
        self._end_leg("eof")

    def _events(self, events: list[SSEEvent]) -> None:
        if self._verdict is None:
            self._clock()
            self._forward(events)

    def _clock(self) -> None:
        """A read with events came: the leg's first-event time or its gap, and its stall
        limit re-armed."""
        now = self._loop.time()
        if self._first:
            self._first = False
            self.p.observe_ttfb(self.ep, now - self._started)  # type: ignore[arg-type]
            self.ep.observe_first(self, now - self._started)  # type: ignore[union-attr]
        elif self._last_event:
            gap = now - self._last_event
            self.ep.latency.gap(gap)  # type: ignore[union-attr]  # (`Endpoint.observe_gap`)
            self._gaps += 1
            if gap > self._gap_max:
                self._gap_max = gap
            if self._gaps == STALL_LEARN:
                self._rearm_at = 0.0  # the learned (shorter) limit applies from now
        self._last_event = now
        if now > self._rearm_at and self._tmo is not None:
            # Re-armed sparingly (a timer move per chunk costs): at most every quarter limit.
            limit = self._stall_limit()
            self._tmo.reschedule(now + limit)
            self._rearm_at = now + limit / 4

    def _forward(self, events: list[SSEEvent]) -> None:
        try:
            verdict = self._take(events)
        except (ClientGone, SlowClient) as e:
            self._exc = e
            self._end_leg("client")
            return
        if verdict is not None:
            self._end_leg(verdict)

    def _emit(self, data: bytes) -> None:
        """To the client now if its socket takes it, else through the task (in order)."""
        if not self._outq and self.sink is not None and self.sink.send_nowait(data):
            return
        self._outq.append(data)
        self._wake_up()

    def _take(self, events: list[SSEEvent]) -> str | None:
        """Forward a batch of events (`Transform.take`), observe the tokens' times, write
        what came out; "done" at a proper end, a reason at a break."""
        out: list[bytes] = []
        tokens, verdict = self.x.take(events, out)
        if out:
            if tokens:
                now = time.monotonic()
                if self._last_token == 0.0:
                    ttft, self._itl = self.p.metrics.for_pool(self.ep.pool if self.ep else "none")
                    ttft.observe(now - self.t0)
                else:
                    self._itl.observe(now - self._last_token)
                if tokens > 1:
                    self._itl.observe_zeros(tokens - 1)
                self._last_token = now
            self._emit(out[0] if len(out) == 1 else b"".join(out))
        return verdict

    async def _send(self, data: bytes) -> None:
        if self.sink is None:
            assert self.ep is not None
            self.resp = web.StreamResponse(
                headers={**SSE_HEADERS, **self.p.response_headers(self.headers, self.ep)}
            )
            await self.resp.prepare(self.request)
            self.sink = self.p.stream_sink(self.request, self.resp)
        await self.sink.send(data)

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
