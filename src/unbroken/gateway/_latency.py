"""Latency-aware routing: least load weighted by what the gateway measures of each endpoint.

The controller needs a few hundred milliseconds of evidence before it calls an endpoint
contended; the gateway sees a replica slow down within one decode step, because it reads
every stream of every endpoint itself. This policy uses that:

- **Per endpoint, from the gateway's own streams** (`EndpointLatency`, fed by the relay):
  the time from a leg's response headers to its first event (TTFB), the gaps between a
  stream's events (one decode step each: every stream of an engine sees the same steps), and
  the legs still waiting for their first event (the engine's prefill queue as this gateway
  made it). The gap is averaged over every event of a short window (`gap_window_s`: the
  gateway's own scheduling shifts single gaps, not their mean) and smoothed across windows
  (`gap_alpha`), so a slower step shows within two windows. While that gap stands more than
  `rise_min` above its own slow average (`trend_s`), the expected time is multiplied by
  `(gap / slow average) ** rise_power`: an endpoint that is slowing down is avoided before
  its smoothed gap has caught up (the first tenth of a second of a contention episode, when
  a request admitted there waits out slower prefill and decode steps); one slow all along
  is weighed by its gap alone. A window that took a long prefill (the legs whose first event
  came in it or in the window before, their prompts at `prefill_s_per_token`, at least
  `prefill_rise_share` of a step) counts towards the rise only as far as the window before
  it was as slow (`gap_rise_s`): one long step is no slowdown, and counted squared it sent a
  shared prompt's next requests to replicas without it, whose own prefills then read as
  rises there (shared-prefix passes collapsed to 81-88 % hits, docs/bench.md). Two such
  windows running (a burst of prefills) do count. The first-event time is a peak EWMA (a
  slower one counts at once, faster ones pull it back down over `ttfb_decay_s`); a signal
  with no new sample for `stale_s` fades, so an endpoint avoided for what it once showed is
  tried again, not starved.
- **Expected time to first token** of a new request on an endpoint:
  `max(TTFB, first_steps x gap, age of its oldest waiting leg, floor_s) x (1 + pending /
  pending_scale)`: a first token waits out the step in progress and its own prefill step, and
  every leg queued ahead adds prefill work; below `floor_s` differences are jitter. Pending
  are the legs waiting for their first event and the picks whose leg has not started yet
  (its upstream request is sent after an await), so that the picks of one burst (a dozen
  users' next turns within milliseconds) see each other rather than all going to the
  endpoint that looked fastest before it.
- **Pick within a pool**: the lowest `(load + 1) x expected`, load being the least-load score
  (in-flight + engine queue + KV); ties round-robin. With no measurements it is least load.
- **Spill across pools** (a new request only): the route's first pool is kept unless (a) its
  best endpoint has a prefill backlog made by this gateway (`spill_backlog` legs or more
  waiting for their first event: a burst of continuations after a crash, a drain or the
  controller moving streams) and is expected to be `spill_ratio` times slower (and
  `spill_min_s` more) than a later pool's best, or (b) SLO-aware spill: the request is not
  critical, the first pool's expected first token misses the priority's target
  (`ttft_targets`; no target: always), its best endpoint carries at least `slo_min_load`,
  and a later pool's best key is `slo_ratio` times lower, load included. So critical work
  stays on the first tier (fp16) while it has room, and standard and sheddable work fills a
  fallback tier that would otherwise idle, only as far as that tier is clearly faster. A
  retry or a continuation (a pick that excludes an endpoint) keeps to the route's order:
  spreading a burst of continuations over the tiers would put prefill work in front of new
  requests everywhere.

- **Late steps and waiting legs**: the time since an endpoint's last event is a signal too.
  Once it passes `late_ratio` x the slow gap average, the step in progress is late and counts
  as a rise at once (`late`), so new requests go elsewhere within a step of a slowdown's
  start; and a stream admitted there during the late step (after its latest event, so not
  in the step: its prefill waits for the next one), still waiting for its first event with
  nothing sent to its client, is re-sent to a replica of its own pool (`Pool.reroute`)
  that expects a first token `reroute_ratio` times sooner and has shown progress since this
  endpoint went late (`reroute`; the gateway's watch asks when an endpoint could turn late,
  `late_in`, and every 10 ms while one is).
  That first tenth of a second is when a contention episode makes its slowest first
  tokens, before the controller has the evidence to act. A stream sent before the latest
  event is in the step in progress (often the very prefill that makes it long): moving it
  would only lose that place.

Slow clients change none of it: the gateway reads every upstream at engine speed and buffers
for the client, so a slow reader changes neither the gaps nor the first-event times.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from unbroken.gateway._policy import Candidate

if TYPE_CHECKING:
    from unbroken.gateway._policy import PickRequest

__all__ = ["EndpointLatency", "LatencyAware", "LatencyCandidate", "LatencySettings"]


class LatencyCandidate(Candidate, Protocol):
    """An endpoint as the latency-aware pick reads it (`_pool.Endpoint` is the one kind; a
    protocol, so that this module need not import the pool, which imports it)."""

    latency: EndpointLatency
    _rr: int  # when it was last picked: ties go to the one picked longest ago


# Whatever endpoint type the pool routes (`_pool.Endpoint`), read as a LatencyCandidate.
Endpoint = TypeVar("Endpoint", bound=LatencyCandidate)


# A pick counts as pending until its leg starts (a stream's, a few ms later), or for this
# long: a burst's picks come within ~20 ms; a non-streaming request (no leg is tracked) or
# one refused before its upstream request stops counting then.
PICK_LAPSE_S = 0.05


@dataclass(frozen=True)
class LatencySettings:
    """The policy's knobs (docs/gateway.md, "Routing")."""

    gap_window_s: float = 0.05  # gaps are averaged over windows this long
    gap_alpha: float = 0.5  # EWMA weight of one window's mean gap
    ttfb_decay_s: float = 0.25  # a peak first-event time decays with this time constant
    stale_s: float = 1.0  # a signal with no new sample for this long fades (this time constant)
    first_steps: float = 2.0  # a first token waits out about this many decode steps
    floor_s: float = 0.02  # expected times below this are equal (event-loop and network jitter)
    pending_scale: float = 16.0  # this many legs waiting for a first event add one expected TTFT
    spill_backlog: int = 8  # legs waiting for a first event that make a backlog
    spill_ratio: float = 2.0  # ... a later pool is taken when the first is this many times slower
    spill_min_s: float = 0.05  # ... and at least this much slower
    trend_s: float = 2.0  # time constant of the slow gap average a rise is judged against
    # The step in progress is late: no event on any of an endpoint's streams for this many
    # times its slow gap average (steady steps vary by < 1.4x, measured in the demo).
    late_ratio: float = 1.5
    # ... plus this per prompt token of the legs the step in progress took (`_late_after`)
    prefill_s_per_token: float = 40e-6
    # A stream still waiting for its first event on a late endpoint is re-sent where a new
    # request's expected first token is this many times sooner (None: never).
    reroute_ratio: float | None = 2.0
    rise_min: float = 0.1  # a rise counts above (1 + this) x the slow average
    rise_power: float = 2.0  # ... as (gap / slow average) ** this on the expected time
    # A window whose legs' first events (or the window before's) bring this share of a
    # step's time in prefill, or more, rises only as far as the window before it
    # (`EndpointLatency.gap_rise_s`).
    prefill_rise_share: float = 0.5
    # SLO-aware spill (standard, sheddable): a later pool whose key is this many times lower
    # takes a new request when the first pool's expected first token misses the priority's
    # target (seconds; None: no target, spill whenever clearly faster). None: off.
    slo_ratio: float | None = 1.5
    # ... and only once the first pool's best endpoint carries this much load: a continuous
    # batch of a few sequences meets any target, and spilling them buys nothing.
    slo_min_load: float = 16.0
    ttft_targets: Mapping[str, float | None] = field(default_factory=dict)


class EndpointLatency:
    """What this gateway's streams say about one endpoint's speed. Updated by the relay
    (`leg_started`, `first_event`, `gap`, `leg_ended`), read by the policy (`expected`)."""

    __slots__ = (
        "_live",
        "_n",
        "_own",
        "_picked",
        "_prefill",
        "_prev_mean",
        "_prev_prefill_s",
        "_rise_share",
        "_s_per_token",
        "_sum",
        "_win_prefill_s",
        "_window_at",
        "alpha_gap",
        "gap_at",
        "gap_rise_s",
        "gap_s",
        "gap_slow_s",
        "gap_window_s",
        "last_at",
        "trend_s",
        "ttfb_at",
        "ttfb_decay_s",
        "ttfb_s",
        "waiting",
    )

    def __init__(self, settings: LatencySettings | None = None) -> None:
        s = settings or _DEFAULT
        self.alpha_gap, self.gap_window_s, self.ttfb_decay_s, self.trend_s = (
            s.gap_alpha,
            s.gap_window_s,
            s.ttfb_decay_s,
            s.trend_s,
        )
        self._sum, self._n, self._window_at = 0.0, 0, 0.0
        self.ttfb_s: float | None = None
        self.ttfb_at = 0.0
        self.gap_s: float | None = None
        self.gap_slow_s: float | None = None  # the gap's average over ~trend_s
        # `gap_s`, but a window that took a long prefill enters it as the lower of its mean
        # and the window before's: what a rise is judged by (`rise`).
        self.gap_rise_s: float | None = None
        self._prev_mean: float | None = None
        self._s_per_token, self._rise_share = s.prefill_s_per_token, s.prefill_rise_share
        # Prefill (seconds) of the legs whose first event came in this window, the last one
        self._win_prefill_s = self._prev_prefill_s = 0.0
        self.gap_at = 0.0
        self.waiting: dict[int, float] = {}  # legs without a first event: id -> start
        # Per waiting leg, the prefill of its own uncached prompt (seconds, the cache-aware
        # policy's estimate): taken out of its first-event time, which then measures what
        # any new request waits for here (the step in progress, the others' prefills), and
        # a replica that just prefilled a prompt it did not hold does not look slow for it.
        self._own: dict[int, float] = {}
        # ... and the prompt tokens each may bring to the step that takes it (`_late_after`)
        self._prefill: dict[int, float] = {}
        self._live: set[int] = set()  # legs past their first event
        self.last_at = 0.0  # the latest event of any of its streams
        # Picks whose leg has not started yet (its upstream request is sent after an await):
        # counted as waiting at once, so that the picks of one burst see each other
        # (`pending`); a pick whose leg never starts lapses after PICK_LAPSE_S.
        self._picked: deque[float] = deque()

    # -- fed by the relay -------------------------------------------------------------------
    def leg_started(
        self,
        leg: object,
        now: float | None = None,
        prefill_tokens: float = 0.0,
        own_prefill_s: float = 0.0,
    ) -> None:
        """`prefill_tokens`: the prompt tokens the leg may bring to the engine step that
        takes it (`_pool._Legs`), so that a step made long by that prefill is not taken for
        a late one (`_late_after`). `own_prefill_s`: what prefilling the part of its prompt
        the endpoint is not credited with costs (`_own`)."""
        self.waiting[id(leg)] = time.monotonic() if now is None else now
        if self._picked:
            self._picked.popleft()
        if prefill_tokens:
            self._prefill[id(leg)] = prefill_tokens
        if own_prefill_s > 0.0:
            self._own[id(leg)] = own_prefill_s

    def picked(self, now: float) -> None:
        """A policy chose this endpoint for a new leg (`LatencyAware._chose`)."""
        self._picked.append(now)

    def pending(self, now: float) -> int:
        """Legs waiting for their first event, and picks whose leg has not started yet."""
        p = self._picked
        while p and now - p[0] > PICK_LAPSE_S:
            p.popleft()
        return len(self.waiting) + len(p)

    def leg_ended(self, leg: object) -> None:
        self._prefill.pop(id(leg), None)
        self._own.pop(id(leg), None)
        if self.waiting.pop(id(leg), None) is None:
            self._live.discard(id(leg))

    def first_event(self, leg: object, seconds: float, now: float | None = None) -> None:
        """Peak EWMA: a slower first event counts at once, a faster one pulls the estimate
        down with the time since the last sample (`ttfb_decay_s`). The leg's own prefill
        (`_own`) is not counted."""
        if self.waiting.pop(id(leg), None) is not None:
            self._win_prefill_s += self._prefill.pop(id(leg), 0.0) * self._s_per_token
            own = self._own.pop(id(leg), 0.0)
            if own:
                seconds = max(0.0, seconds - own)
            self._live.add(id(leg))
        now = time.monotonic() if now is None else now
        self.last_at = now
        t = self.ttfb_s
        if t is None or seconds >= t:
            self.ttfb_s = seconds
        else:
            w = math.exp(-max(0.0, now - self.ttfb_at) / self.ttfb_decay_s)
            self.ttfb_s = seconds + (t - seconds) * w
        self.ttfb_at = now

    def gap(self, seconds: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.last_at = now
        if self._n and now - self._window_at >= self.gap_window_s:
            mean, g, slow = self._sum / self._n, self.gap_s, self.gap_slow_s
            self.gap_s = mean if g is None else g + self.alpha_gap * (mean - g)
            # Its step's first events may have come just before the window opened.
            took = max(self._win_prefill_s, self._prev_prefill_s)
            prev, r = self._prev_mean, self.gap_rise_s
            m = mean
            if prev is not None and slow and took > 0.0 and took >= self._rise_share * slow:
                m = min(mean, prev)
            self.gap_rise_s = m if r is None else r + self.alpha_gap * (m - r)
            self._prev_mean, self._prev_prefill_s = mean, self._win_prefill_s
            self._win_prefill_s = 0.0
            if slow is None:
                self.gap_slow_s = mean
            else:
                w = 1.0 - math.exp(-max(0.0, now - self.gap_at) / self.trend_s)
                self.gap_slow_s = slow + w * (mean - slow)
            self.gap_at = now
            self._sum, self._n = 0.0, 0
        if not self._n:
            self._window_at = now
        self._sum += seconds
        self._n += 1

    def behind(self, leg: object) -> bool:
        """Is `leg` waiting, and did it start after the latest event, so that it is not in
        the step in progress but waits for the next?"""
        started = self.waiting.get(id(leg))
        return started is not None and started > self.last_at

    # -- read by the policy -----------------------------------------------------------------
    def measured(self, now: float, s: LatencySettings) -> float | None:
        """Expected first-token time before queueing, from the samples; None when nothing
        has been measured. Each signal older than `stale_s` fades (with that time constant):
        an endpoint that gets no new legs keeps no first-event time it once showed, and one
        whose streams all ended keeps no gap."""
        out: float | None = None
        if self.ttfb_s is not None:
            out = self.ttfb_s * _fade(now - self.ttfb_at, s.stale_s)
        if self.gap_s is not None:
            fade = _fade(now - self.gap_at, s.stale_s)
            gap = self.gap_s
            late = self.late(now, s)
            if late > 1.0:  # the step in progress is already longer than the average
                gap = max(gap, now - self.last_at)
            g = s.first_steps * gap * fade
            out = g if out is None else max(out, g)
            rise = max(self.rise(s), late)
            if rise > 1.0:
                out *= 1.0 + (rise**s.rise_power - 1.0) * fade
        return out

    def rise(self, s: LatencySettings) -> float:
        """How far the smoothed gap (a long prefill's window discounted: `gap_rise_s`) stands
        above its slow average; 1.0 within `rise_min`."""
        g, slow = self.gap_rise_s, self.gap_slow_s
        if g is None or not slow or g <= slow * (1.0 + s.rise_min):
            return 1.0
        return g / slow

    @property
    def live(self) -> bool:
        """Has any of its legs under way had its first event?"""
        return bool(self._live)

    def late(self, now: float, s: LatencySettings) -> float:
        """How late the step in progress is: the time since any of its streams got an event
        over the slow gap average, once above `late_ratio` (and `floor_s`: shorter silences
        are the event loop's jitter); else 1.0. Seen within a step of
        a slowdown's start, before any slow gap has been measured (the windows' mean needs
        the slow step to end, and then a window to close)."""
        slow, after = self.gap_slow_s, self._late_after(s)
        if slow is None or after is None:
            return 1.0
        age = now - self.last_at
        return age / slow if age > after else 1.0

    def late_in(self, now: float, s: LatencySettings) -> float | None:
        """Seconds until the step in progress counts as late (`late`) if no event comes
        first: 0.0 once it does; None while it cannot (nothing past its first event, or no
        slow gap measured yet)."""
        after = self._late_after(s)
        return None if after is None else max(0.0, self.last_at + after - now)

    def _late_after(self, s: LatencySettings) -> float | None:
        """The silence after which the step in progress is late; None while nothing can be.
        The step in progress takes the legs sent here before its latest event that still
        wait for their first, and their prefill lengthens it (a 1,000-token prompt is ~40 ms
        on a 10 ms decode step): no slowdown, so it is allowed for. Read as late, such steps
        multiplied the endpoint's expected first token by the rise squared, steered the
        prompt's next requests to a replica without its prefix and re-sent the legs behind
        it there (benchmarks/routing.py, shared-prefix, docs/bench.md)."""
        slow = self.gap_slow_s
        if not self._live or not slow:
            return None
        after = max(s.late_ratio * slow, s.floor_s)
        if self._prefill:
            last, waiting = self.last_at, self.waiting  # every `_prefill` leg is waiting
            tokens = sum(t for k, t in self._prefill.items() if waiting[k] <= last)
            after += tokens * s.prefill_s_per_token
        return after

    def expected(self, now: float, prior: float | None, s: LatencySettings) -> float | None:
        """Expected time to a new request's first token here; `prior` (the best sibling's)
        stands in when nothing has been measured."""
        base = self.measured(now, s)
        if base is None:
            base = prior
        if self.waiting:
            oldest = now - min(self.waiting.values())
            base = oldest if base is None else max(base, oldest)
        if base is None:
            return None
        return max(base, s.floor_s) * (1.0 + self.pending(now) / s.pending_scale)

    def as_dict(self, now: float, s: LatencySettings | None = None) -> dict[str, Any]:
        s = s or _DEFAULT
        exp = self.expected(now, None, s)
        return {
            "ttfb_ms": None if self.ttfb_s is None else round(self.ttfb_s * 1e3, 2),
            "gap_ms": None if self.gap_s is None else round(self.gap_s * 1e3, 2),
            "gap_rise": round(self.rise(s), 3),
            "late": round(self.late(now, s), 3),
            "awaiting_first": len(self.waiting),
            "pending": self.pending(now),  # awaiting_first, plus picks whose leg has not started
            "expected_ttft_ms": None if exp is None else round(exp * 1e3, 2),
        }


_DEFAULT = LatencySettings()


def _fade(age: float, stale_s: float) -> float:
    return 1.0 if age <= stale_s else math.exp(-(age - stale_s) / stale_s)


class LatencyAware:
    """The default routing policy: least load weighted by expected time to first token, and
    a spill to a later pool of the route when the first one is much slower (module doc)."""

    def __init__(self, settings: LatencySettings | None = None) -> None:
        self.s = settings or _DEFAULT
        self._tick = itertools.count(1)
        self.spills = 0  # new requests sent past the route's first pool
        self.avoided = 0  # picks where the least-loaded candidate was passed over

    def _prior(self, candidates: Sequence[Endpoint], now: float) -> float | None:
        known = [m for e in candidates if (m := e.latency.measured(now, self.s)) is not None]
        return min(known) if known else None

    def _costs(
        self, candidates: Sequence[Endpoint], now: float, prior: float | None, request: PickRequest
    ) -> list[tuple[float | None, float]]:
        """Per candidate: (expected first-token time or None when nothing is known, the key
        it is ranked by: (load + 1) x expected). A cache-aware policy adds the prefill of the
        part of the prompt a candidate does not hold."""
        out: list[tuple[float | None, float]] = []
        for e in candidates:
            exp = e.latency.expected(now, prior, self.s)
            out.append((exp, (e.load + 1.0) * (exp if exp is not None else 1.0)))
        return out

    def _best(
        self,
        candidates: Sequence[Endpoint],
        now: float,
        prior: float | None,
        request: PickRequest,
    ) -> tuple[Endpoint | None, float | None, float]:
        """The candidate with the lowest key, its expected time and its key."""
        if not candidates:
            return None, None, 0.0
        costs = self._costs(candidates, now, prior, request)
        i = self._lowest(candidates, costs)
        return candidates[i], costs[i][0], costs[i][1]

    @staticmethod
    def _lowest(candidates: Sequence[Endpoint], costs: Sequence[tuple[float | None, float]]) -> int:
        """Index of the lowest key; a tie goes to the candidate picked longest ago."""
        return min(range(len(candidates)), key=lambda i: (costs[i][1], candidates[i]._rr))

    def _chose(self, ep: Endpoint, candidates: Sequence[Endpoint], now: float) -> Endpoint:
        if min(candidates, key=lambda e: (e.load, e._rr)) is not ep:
            self.avoided += 1
        ep._rr = next(self._tick)
        ep.latency.picked(now)
        return ep

    def pick(self, candidates: list[Endpoint], request: PickRequest) -> Endpoint | None:
        now = time.monotonic()
        best, _, _ = self._best(candidates, now, self._prior(candidates, now), request)
        return None if best is None else self._chose(best, candidates, now)

    def pick_route(
        self, pools: list[list[Endpoint]], request: PickRequest, *, fresh: bool
    ) -> Endpoint | None:
        """Choose among the route's pools (each a non-empty candidate list, in the route's
        order). `fresh`: a new request (not a retry or a continuation), which may spill."""
        if not pools:
            return None
        now = time.monotonic()
        if not fresh or len(pools) == 1:
            return self.pick(pools[0], request)
        prior = self._prior([e for c in pools for e in c], now)
        chosen, first_exp, first_key = self._best(pools[0], now, prior, request)
        among = pools[0]
        if chosen is None:
            return None
        backlog = first_exp is not None and len(chosen.latency.waiting) >= self.s.spill_backlog
        # SLO: standard and sheddable work leaves the first pool when it misses the
        # priority's first-token target (or has none) and a later pool is clearly faster,
        # load included; critical work stays while the first pool has room.
        target = self.s.ttft_targets.get(request.priority)
        slo = request.priority != "critical" and self.s.slo_ratio is not None
        slo = slo and chosen.load >= self.s.slo_min_load
        slo = slo and (target is None or (first_exp is not None and first_exp > target))
        if backlog or slo:
            for cands in pools[1:]:
                other, other_exp, other_key = self._best(cands, now, prior, request)
                if other is None:
                    continue
                if (
                    backlog
                    and first_exp is not None
                    and other_exp is not None
                    and first_exp > self.s.spill_ratio * other_exp
                    and first_exp - other_exp > self.s.spill_min_s
                ) or (slo and first_key > self.s.slo_ratio * other_key):  # type: ignore[operator]
                    chosen, among = other, cands
                    self.spills += 1
                    break
        return self._chose(chosen, among, now)

    def late(self, ep: Endpoint) -> bool:
        """Is `ep`'s step in progress late (`EndpointLatency.late`)?"""
        return ep.latency.late(time.monotonic(), self.s) > 1.0

    def late_in(self, ep: Endpoint) -> float | None:
        """Seconds until `ep`'s step in progress would count as late (`EndpointLatency.late_in`)."""
        return ep.latency.late_in(time.monotonic(), self.s)

    def reroute(self, ep: Endpoint, candidates: Sequence[Endpoint], request: PickRequest) -> bool:
        """Should a leg waiting for its first event on `ep` be re-sent? Only when `ep`'s step
        in progress is late, and one of `candidates` (`ep`'s pool without it: `Pool.reroute`)
        expects a new request's first token `reroute_ratio` times sooner than `ep` does, that
        request's prefill included."""
        ratio = self.s.reroute_ratio
        if ratio is None or not candidates:
            return False
        now = time.monotonic()
        lat = ep.latency
        if lat.late(now, self.s) <= 1.0 or lat.gap_slow_s is None:
            return False
        # A target must have shown progress since `ep` went late: in a host-wide stall (a
        # neighbour's weight read, the node's memory reclaim) every engine is late at once,
        # each seen late a step after the other, and a move would only lose the place in
        # the queue. One with no stream under way has nothing to show; its next step starts
        # fresh.
        went_late = lat.last_at + self.s.late_ratio * lat.gap_slow_s
        moving = [e for e in candidates if not e.latency.live or e.latency.last_at > went_late]
        if not moving:
            return False
        prior = self._prior(candidates, now)
        here = lat.expected(now, prior, self.s)
        _, there, _ = self._best(moving, now, prior, request)
        return here is not None and there is not None and here > ratio * there
