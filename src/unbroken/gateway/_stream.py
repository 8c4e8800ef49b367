"""One client stream, relayed from one or more upstream legs.

Leg 0 is the original request. A leg whose first event does not come within the endpoint's
time-to-first-byte limit is cut; for leg 0 nothing has reached the client yet, so the request
is retried elsewhere. When a leg breaks after the client has received something
(connection reset, engine crash, no event for `stall_timeout_s`, an error event, a stream cut
short, or the drain deadline of its endpoint), the stream continues on another ready endpoint
(see `_continuation`) and the new leg is spliced in: same id and created time, no second role
chunk, usage added up, one finish. With greedy decoding the client receives exactly the text
an unbroken stream would have produced.

The relay is a stack of layers, one concept each, read bottom-up: the stream's state
(`_stream_state`), what a break does (`_stream_breaks`: continue or end), a stream moved to
another process (`_stream_handover`), and here, on top, one leg: its time limits and the
upstream's read callback, where a relayed chunk's own work is done (`_on_body`: the usual
read, one token event, handled inline). What the relay needs of the gateway is
`_stream_host.RelayHost`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from unbroken.gateway import _later as later
from unbroken.gateway._messages import SNAPSHOT_VERSION
from unbroken.gateway._pool import Endpoint
from unbroken.gateway._relay import ClientGone, SlowClient
from unbroken.gateway._stream_breaks import _DYING as _DYING
from unbroken.gateway._stream_breaks import _MAX_SPLIT_BACK as _MAX_SPLIT_BACK
from unbroken.gateway._stream_breaks import HANDOVER, BreakingRelay
from unbroken.gateway._stream_breaks import log as log
from unbroken.gateway._stream_handover import HandoverRelay
from unbroken.gateway._stream_host import RelayHost
from unbroken.gateway._stream_state import RelayState
from unbroken.gateway._transform import PROTOCOL
from unbroken.gateway._upstream import UpstreamResponse
from unbroken.wire.sse import EventTooLarge, SSEDecoder, SSEEvent, encode_data

# Re-exported: they were defined here before the split (issue 22), and may be imported
# from here by callers not yet moved to their new modules.
__all__ = [
    "HANDOVER",
    "SNAPSHOT_VERSION",
    "BreakingRelay",
    "HandoverRelay",
    "RelayHost",
    "RelayState",
    "StreamRelay",
]


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


class StreamRelay(HandoverRelay):
    """One client stream and its legs (module doc)."""

    __slots__ = ()

    # -- called by the gateway ------------------------------------------------------------
    def interrupt(self, reason: str) -> None:
        """Cut the current leg now (drain deadline); the stream continues elsewhere."""
        if self.interrupted is None:
            self.interrupted = reason
            if self.up is not None:
                self.up.close()
                self._end_leg("reset")

    def first_pending(self, ep: Endpoint) -> bool:
        """Is this stream's leg on `ep` still waiting for its first event, with nothing sent
        to the client (so that it can be re-sent elsewhere as a plain retry)?"""
        return self.ep is ep and self._first and self.sink is None and self.interrupted is None

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
        if self._held or (self._last_token and later.ENABLED and self._verdict is None):
            # After the stream's first token: taken once this pass's new work has run.
            self._hold(self._take_chunk, chunk)
            return
        self._take_chunk(chunk)

    def _hold(self, take: Callable[[Any], None], arg: object) -> None:
        """`take(arg)` in `_later`'s turn, behind what this stream holds already."""
        self._held += 1
        self._later.hold(self._take_held, (self.up, take, arg))

    def _take_held(
        self, held: tuple[UpstreamResponse | None, Callable[[Any], None], object]
    ) -> None:
        self._held -= 1
        up, take, arg = held
        if up is self.up and self._verdict is None:  # else its leg has ended: dropped
            take(arg)

    def _take_chunk(self, chunk: bytes) -> None:
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
                self._write(raw)
                return
        try:
            events = dec.feed(chunk)
        except EventTooLarge as e:
            self.x.detail = str(e)
            self._end_leg(PROTOCOL)
            return
        if events:
            self._events(events)

    def _write(self, raw: bytes) -> None:
        try:
            self._emit(raw)
        except (ClientGone, SlowClient) as e:
            self._exc = e
            self._end_leg("client")

    def _on_end(self, exc: BaseException | None) -> None:
        if self._held:
            self._hold(self._take_end, exc)  # after the chunks held
            return
        self._take_end(exc)

    def _take_end(self, exc: BaseException | None) -> None:
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
            data = out[0] if len(out) == 1 else b"".join(out)
            if verdict == "done" and self.sink is not None and not self._outq:
                # The end: written with the response's terminator in one write (`finish`),
                # one syscall and one wake-up of the client fewer per request.
                self._tail = data
            else:
                self._emit(data)
        return verdict
