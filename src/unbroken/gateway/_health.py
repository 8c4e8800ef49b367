"""Per-endpoint health as the data path sees it: what each endpoint's requests taught the
gateway, and the one verdict on a failure (`upstream_failed`).

The records: each endpoint's recent first-event times (its time-to-first-byte limit,
`ttfb_limit`), its recent non-streaming answers (`answer_limit`), when it last answered
(`alive`: an endpoint producing tokens is slow, not hung), its run of 5xx, and the request
forms it refused (`refuses`). The rules built on them: how long a late first byte or a late
answer is waited for (`first_byte_patience`, `answer_patience`, `patience`), and when a
failure takes an endpoint out of rotation: a connection failure until its next health check,
a hang, an abort, a protocol break, vLLM's graceful-shutdown answer or `_5XX_RUN` 5xx in a row
until it serves a real completion again (`on_hang`: the prober's `suspect`, which holds it
out, in the main process; a worker forwards it there). Streams on an endpoint out of rotation
get the short stall limit (`watch_streams`).

What lives elsewhere, and why: the prober (`_prober`) owns /health, readiness and the hold of
a suspect (it runs where the probes run: the main process); a stream's own stall limit,
learned from its gaps, and the alert to its siblings when it dies are the relay's
(`_stream.StreamRelay.alert`), since they are per stream, not per endpoint.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from unbroken.gateway._pool import Endpoint, Pool

if TYPE_CHECKING:
    from unbroken.config.spec import GatewaySettings
    from unbroken.gateway._metrics import GatewayMetrics

__all__ = ["ALIVE_S", "LATE_FIRST", "LATE_MOVES", "EndpointHealth"]

log = logging.getLogger("unbroken.gateway")
LATE_FIRST = "late_first"  # the interrupt of a leg re-sent for a late step
LATE_MOVES = 3  # ... at most this many times per request (`_forward`)

# Hang detection learns each endpoint's time to first byte from this many recent streams.
_TTFB_SAMPLES = 32
_TTFB_FACTOR = 4.0
# vLLM's answer to new requests during its graceful shutdown (its /health stays 200).
_SHUTTING_DOWN = "cannot schedule new futures after shutdown"
# This many 5xx in a row (no success between) take an endpoint out until readiness.
_5XX_RUN = 3
# One engine failure breaks every stream on it at once: their warnings, one per endpoint and
# kind this often (`EndpointHealth._log_failure`), the rest at debug level.
FAILURE_LOG_S = 10.0
_WATCH_S = 0.5
# While legs wait for a first event, endpoints are looked at this often for a late step
# (`_latency.EndpointLatency.late`): a step is ~20-40 ms, a slowdown is seen in ~1.5 of them.
_LATE_WATCH_S = 0.01  # at most this often; armed for when an endpoint could turn late
# ...and at least this often while legs wait where no endpoint can tell yet (nothing past
# its first event, no slow gap measured). Every 10 ms regardless cost 1.04x the CPU per
# relayed chunk at 256 streams (benchmarks/relay_ab.py): its wake-ups split the loop's reads.
_LATE_WATCH_IDLE_S = 0.05
# An endpoint whose streams got an event this recently is producing tokens: slow to answer
# a new request (its queue), not hung.
ALIVE_S = _ALIVE_S = 1.0
# How long before a first-byte limit fires its endpoint's liveness is looked at.
_PATIENCE_LEAD_S = 0.05
# A non-streaming answer comes whole, its time growing with its tokens: each endpoint learns
# it from this many recent answers (seconds, completion tokens per sequence), and a new
# request may take _ANSWER_FACTOR x the slowest of them scaled to its own max_tokens.
_ANSWER_SAMPLES = 32
_ANSWER_FACTOR = 4.0
# A request without max_tokens is expected to be at most this long (or twice the longest
# answer seen), in tokens per sequence.
_ANSWER_TOKENS_UNKNOWN = 256
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')


class _Patience:
    """The watch of `EndpointHealth.patience`. An object rather than a closure that
    schedules itself: such a closure refers to itself through its cell, a reference cycle
    that took the request's task, its time limit and their contexts with it (18 objects a
    request) until the cyclic collector ran; in the gateway workers its collections then
    took ~2 ms each, twice a second, with the event loop stopped (docs/performance.md)."""

    __slots__ = ("_decide", "_handle", "_loop", "_tmo")

    def __init__(self, tmo: asyncio.Timeout, decide: Callable[[float], float | None]) -> None:
        self._tmo, self._decide = tmo, decide
        self._loop = asyncio.get_running_loop()
        self._handle: asyncio.TimerHandle | None = None
        first = tmo.when()
        if first is not None:
            self._handle = self._loop.call_at(first - _PATIENCE_LEAD_S, self._check)

    def _check(self) -> None:
        self._handle = None  # fired: the loop no longer holds it
        tmo = self._tmo
        when = tmo.when()
        if when is None or tmo.expired():
            return
        now = self._loop.time()
        if when - now > _PATIENCE_LEAD_S:  # moved since (an event re-armed it)
            self._handle = self._loop.call_at(when - _PATIENCE_LEAD_S, self._check)
        elif (new := self._decide(now)) is not None and new > when:
            tmo.reschedule(new)
            self._handle = self._loop.call_at(new - _PATIENCE_LEAD_S, self._check)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


class EndpointHealth:
    """The records and rules above, for every endpoint of one process's pool."""

    def __init__(self, cfg: GatewaySettings, pool: Pool, metrics: GatewayMetrics) -> None:
        self.cfg = cfg
        self.pool = pool
        self.metrics = metrics
        self._ttfb: dict[str, deque[float]] = {}
        self._answers: dict[str, deque[tuple[float, float]]] = {}
        self._answered: dict[str, float] = {}  # loop time of each endpoint's last answer
        self._5xx: dict[str, int] = {}  # 5xx answers in a row, per endpoint
        # Per (endpoint, kind): when its failure was last logged at WARNING, and how many
        # since went to DEBUG (one engine's crash breaks every stream on it: a review
        # counted 16 identical warnings for 16 streams, ~512 at 256 streams a replica).
        self._said: dict[tuple[str, str], tuple[float, int]] = {}
        # Per endpoint, the kinds of request form it refused (see `_legs.Legs.open`).
        self._refused: dict[str, set[str]] = {}
        self._watchdog: asyncio.Task[None] | None = None
        self._late_watch: asyncio.TimerHandle | None = None
        self.on_hang: Callable[[Endpoint], None] | None = None  # the prober's `suspect`

    def refuses(self, ep: Endpoint) -> set[str]:
        """The sticky request forms `ep` refused (4xx) while taking a later one."""
        return self._refused.get(ep.name, set())

    def refused(self, ep: Endpoint, kind: str) -> None:
        skipped = self._refused.setdefault(ep.name, set())
        if kind not in skipped:
            skipped.add(kind)
            log.info("%s refuses %s requests", ep.name, kind)

    def ttfb_limit(self, ep: Endpoint) -> float:
        """How long `ep` may take to send a stream's first event: a multiple of the slowest
        of its recent first events, within [ttfb_min_s, ttfb_timeout_s]; the ceiling until
        it has served a few."""
        cfg = self.cfg
        seen = self._ttfb.get(ep.name)
        if not seen or len(seen) < 4:
            return cfg.ttfb_timeout_s
        return min(cfg.ttfb_timeout_s, max(cfg.ttfb_min_s, _TTFB_FACTOR * max(seen)))

    def observe_ttfb(self, ep: Endpoint, seconds: float) -> None:
        q = self._ttfb.get(ep.name)
        if q is None:
            q = self._ttfb[ep.name] = deque(maxlen=_TTFB_SAMPLES)
        q.append(seconds)

    def answer_limit(self, ep: Endpoint, tokens: int | None) -> float:
        """How long `ep` may take to answer a non-streaming request for `tokens` tokens per
        sequence: `_ANSWER_FACTOR` x the slowest recent answer of `ep` scaled by token count,
        at least `ttfb_min_s`. Until `ep` has answered, its warm-up is
        its one sample; with no warm-up either, its pool's answers; with none, the ceiling
        `ttfb_timeout_s` (streams' first-byte limit before they learn)."""
        cfg = self.cfg
        samples: list[tuple[float, float]] = list(self._answers.get(ep.name, ()))
        if ep.warmup_s is not None:
            samples.append((ep.warmup_s, 1.0))
        if not samples:
            for e in self.pool.endpoints.values():
                if e.pool == ep.pool:
                    samples.extend(self._answers.get(e.name, ()))
        if not samples:
            return cfg.ttfb_timeout_s
        if tokens is None:
            tokens = max(_ANSWER_TOKENS_UNKNOWN, 2 * int(max(k for _, k in samples)))
        est = max(s * (tokens + 1) / (k + 1) for s, k in samples)
        return max(cfg.ttfb_min_s, _ANSWER_FACTOR * est)

    def observe_answer(self, ep: Endpoint, seconds: float, body: bytes, sequences: int) -> None:
        """A non-streaming answer came whole after `seconds`: a sample for `answer_limit`, and
        a sign of life (`alive`)."""
        self._answered[ep.name] = asyncio.get_running_loop().time()
        m = _COMPLETION_TOKENS.search(body)
        tokens = int(m[1]) / max(1, sequences) if m else 0.0
        q = self._answers.get(ep.name)
        if q is None:
            q = self._answers[ep.name] = deque(maxlen=_ANSWER_SAMPLES)
        q.append((seconds, tokens))

    def answer_patience(
        self,
        model: str,
        priority: str,
        exclude: list[Endpoint],
        deadline: float,
        tokens: int | None,
    ) -> Callable[[Endpoint], Callable[[float], float | None]]:
        """The rule for a non-streaming answer that is late (see `patience`): an endpoint
        still alive (it answers other requests, its streams get events) is busy, not hung,
        and with no other endpoint to try there is nothing better than to wait; either way
        wait its limit again, never past the request's `deadline` (monotonic). Otherwise the
        limit fires and the request is tried elsewhere (nothing was sent to the client)."""
        loop = asyncio.get_running_loop()
        # Loop time and time.monotonic() need not share an origin (uvloop).
        end = deadline - time.monotonic() + loop.time()

        def rule(ep: Endpoint) -> Callable[[float], float | None]:
            def decide(now: float) -> float | None:
                if now >= end:
                    return None
                if self.working(ep) or not self.pool.could_serve(model, priority, [*exclude, ep]):
                    return min(end, now + self.answer_limit(ep, tokens))
                return None

            return decide

        return rule

    def working(self, ep: Endpoint) -> bool:
        """`alive`, or its engine's generated-token count rose at one of the last two
        scrapes: what a long non-streaming answer on an otherwise idle engine shows. Without
        it such an answer past its limit was taken for a hang, its work thrown away and the
        engine taken out of rotation (a review, 2026-12-07). Only for answers and request
        timeouts: a scrape is up to a probe interval old, and a stream's first byte or stall
        has its own events to go by (an engine stopped a second ago must not look busy)."""
        if time.monotonic() - ep.progress_at < max(_ALIVE_S, 2.5 * self.cfg.probe_interval_s):
            return True
        return self.alive(ep)

    def alive(self, ep: Endpoint) -> bool:
        """Did any stream of `ep` get an event, or a request an answer, in the last
        `_ALIVE_S`?"""
        since = asyncio.get_running_loop().time() - _ALIVE_S
        if self._answered.get(ep.name, 0.0) > since:
            return True
        return any(r.last_event > since for r in list(ep.relays))

    def first_byte_patience(self, ep: Endpoint, start: float) -> Callable[[float], float | None]:
        """The rule for a first byte that is late (see `patience`): while `ep` is alive, an
        engine producing tokens for its other streams and slow to start this one has a queue,
        not a hang (under saturation, cutting such requests only turned a slow answer into a
        502); wait the endpoint's limit again, never past `start` + `ttfb_timeout_s`."""
        ceiling = start + self.cfg.ttfb_timeout_s

        def decide(now: float) -> float | None:
            if now < ceiling and self.alive(ep):
                return min(ceiling, now + self.ttfb_limit(ep))
            return None

        return decide

    def patience(
        self, tmo: asyncio.Timeout, decide: Callable[[float], float | None]
    ) -> Callable[[], None]:
        """Just before the time limit `tmo` fires, ask `decide(now)`: a new deadline pushes
        it back (and is watched the same way), None lets it fire. Returns the function that
        stops watching."""
        return _Patience(tmo, decide).stop

    def watch_streams(self) -> None:
        """Start the watch over streams on endpoints that leave rotation (once), and the
        watch over legs waiting for a first event (while there are any)."""
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = asyncio.get_running_loop().create_task(self._watch())
        if self._late_watch is None:
            self._late_watch = asyncio.get_running_loop().call_later(
                _LATE_WATCH_S, self._watch_first
            )

    def _watch_first(self) -> None:
        """A leg still waiting for its first event, with nothing sent to its client, on an
        endpoint whose step in progress is late, is re-sent where the policy expects a first
        token much sooner (`Pool.reroute`): it was admitted just before a slowdown showed.
        Only legs sent after the endpoint's latest event: the others are in the late step,
        often the prefill that makes it long. While any leg waits it runs again when the
        first endpoint with waiting legs could turn late (its latest event + `late_ratio` x
        its slow gap: an event before then pushes that moment on), every `_LATE_WATCH_S` while
        one is late, and every `_LATE_WATCH_IDLE_S` where none can tell; not at all when no
        leg waits."""
        self._late_watch = None
        waiting = False
        next_s = _LATE_WATCH_IDLE_S
        for ep in list(self.pool.endpoints.values()):
            if not ep.latency.waiting:
                continue
            waiting = True
            if not self.pool.late(ep):
                if (d := self.pool.late_in(ep)) is not None:
                    next_s = min(next_s, d)
                continue
            next_s = _LATE_WATCH_S
            moved = 0
            for relay in list(ep.relays):
                if (
                    relay.late_moves < LATE_MOVES
                    and relay.first_pending(ep)
                    and ep.latency.behind(relay)
                    and self.pool.reroute(ep, relay.model, relay.priority, relay.failed, relay.hint)
                ):
                    relay.interrupt(LATE_FIRST)
                    moved += 1
            if moved:
                log.info(
                    "%s's step is late: %d stream(s) waiting for a first token re-sent elsewhere",
                    ep.name,
                    moved,
                )
        if waiting:
            self._late_watch = asyncio.get_running_loop().call_later(
                max(_LATE_WATCH_S, next_s), self._watch_first
            )

    async def _watch(self) -> None:
        """Streams of an endpoint out of rotation (its /health failing, a sibling stream
        reset, hung) get the short stall limit: a dying engine that keeps its connections
        open without events is left in about a second."""
        while True:
            await asyncio.sleep(_WATCH_S)
            for ep in list(self.pool.endpoints.values()):
                if ep.relays and not ep.healthy:
                    for relay in list(ep.relays):
                        relay.alert()

    def upstream_ok(self, ep: Endpoint) -> None:
        """`ep` answered (below 500): its run of 5xx is over."""
        self._5xx.pop(ep.name, None)

    def _log_failure(self, name: str, kind: str, detail: str) -> None:
        """One WARNING per endpoint and kind every FAILURE_LOG_S, saying how many of the same
        went to DEBUG since the last; the rest at DEBUG."""
        now = time.monotonic()
        at, quiet = self._said.get((name, kind), (-FAILURE_LOG_S, 0))
        if now - at < FAILURE_LOG_S:
            self._said[(name, kind)] = (at, quiet + 1)
            log.debug("upstream %s failed (%s): %s", name, kind, detail)
            return
        self._said[(name, kind)] = (now, 0)
        more = f" ({quiet} more of these since the last warning, at debug level)" if quiet else ""
        log.warning(
            "upstream %s failed (%s): %s; the same on its other streams within %.0f s is "
            "logged at debug level%s",
            name,
            kind,
            detail,
            FAILURE_LOG_S,
            more,
        )

    def upstream_failed(self, ep: Endpoint, kind: str, detail: str) -> None:
        """The one verdict on a failure of `ep` (`kind`: connect, reset, status_5xx, ttfb,
        stall, timeout, answer, abort, protocol, truncated): counted, put on its record, and
        out of rotation when it says the engine is gone or hangs; not when it is only slow
        (`alive`)."""
        self.metrics.upstream_errors.labels(ep.name, kind).inc()
        ep.note_error(f"{kind}: {detail}")
        run = 0
        if kind.startswith("status_5"):
            run = self._5xx[ep.name] = self._5xx.get(ep.name, 0) + 1
        if kind in ("connect", "reset"):
            # Out of rotation until its next health check passes.
            ep.healthy = False
        elif (kind in ("ttfb", "stall") and self.alive(ep)) or (
            kind in ("timeout", "answer") and self.working(ep)
        ):
            log.warning(
                "upstream %s slow (%s: %s), not hung: its streams got events, or its engine "
                "generated tokens, within the last seconds; it stays in rotation",
                ep.name,
                kind,
                detail,
            )
            return
        elif self.on_hang is not None and (
            kind in ("ttfb", "stall", "timeout", "answer", "abort", "protocol")
            or _SHUTTING_DOWN in detail
            or run >= _5XX_RUN
        ):
            # /health may stay green while the engine hangs, or while it shuts down (vLLM
            # answers 200 there and refuses new requests with a 500): out of rotation until
            # it serves a real completion again (readiness).
            self.on_hang(ep)
        self._log_failure(ep.name, kind, detail)
