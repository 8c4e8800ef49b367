"""Latency-aware routing (gateway/_latency.py): a replica that slows down gets fewer new
requests within a few decode steps, before any controller acts; slow clients alone never
change where requests go. In-process checks of the policy's arithmetic, then real processes."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers import MODEL, TOKEN, Proc, admin, engine, gateway, metric, ready_endpoint, wait_for
from unbroken.gateway import _latency
from unbroken.gateway._affinity import CacheAware
from unbroken.gateway._latency import EndpointLatency, LatencyAware, LatencySettings
from unbroken.gateway._pool import Endpoint, LeastLoad, PickRequest, Pool
from unbroken.gateway._prefix import CHARS_PER_TOKEN, hint_of

AUTH = {"Authorization": f"Bearer {TOKEN}"}
REQ = PickRequest("m", "standard")


_ep = ready_endpoint


def _gaps(e: EndpointLatency, gap: float, t0: float, t1: float, step: float = 0.01) -> None:
    """Gaps of `gap` seconds every `step` from `t0` until `t1` (excluded)."""
    for i in range(round((t1 - t0) / step)):
        e.gap(gap, now=t0 + i * step)


def _feed(e: Endpoint, gap: float, n: int = 50, ttfb: float | None = None) -> None:
    """`n` gaps spread over the last n x 10 ms (several averaging windows), then a first
    event."""
    now = time.monotonic()
    _gaps(e.latency, gap, now - n * 0.01, now + 0.01)
    if ttfb is not None:
        leg = object()
        e.relays.add(leg)
        e.observe_first(leg, ttfb)
        e.relays.discard(leg)


def _streaming(*eps: Endpoint) -> None:
    """30 ms steps measured, a 60 ms first event, and one stream past its first event now
    (a live leg: what makes an endpoint's silence count as a late step)."""
    for e in eps:
        _feed(e, 0.03, ttfb=0.06)
        leg = object()
        e.relays.add(leg)
        e.observe_first(leg, 0.06)


# -- the policy's arithmetic --------------------------------------------------------------------
def test_without_measurements_it_is_least_load() -> None:
    """No latency seen yet (a new gateway, an idle pool): the same choices as least load."""
    for policy in (LatencyAware(), LeastLoad()):
        a, b, c = _ep("a", inflight=3), _ep("b", inflight=1), _ep("c", inflight=1)
        picks = [policy.pick([a, b, c], REQ) for _ in range(4)]
        assert [p.name for p in picks if p] == ["b", "c", "b", "c"]


def test_a_slower_endpoint_is_picked_less() -> None:
    """Equal loads: the endpoint expected to answer 4x slower is passed over until the other
    carries about 4x its load, then gets about one new request in five."""
    policy = LatencyAware()
    slow, fast = _ep("slow", inflight=10), _ep("fast", inflight=10)
    _feed(slow, 0.080, ttfb=0.15)
    _feed(fast, 0.020, ttfb=0.04)
    ttfb = {"slow": 0.15, "fast": 0.04}
    names = []
    for _ in range(60):
        e = policy.pick([slow, fast], REQ)
        assert e is not None
        names.append(e.name)
        e.slot.add(1)
        # Its leg starts and answers as the relay's would: a pick no longer pending.
        leg = object()
        e.relays.add(leg)
        e.observe_first(leg, ttfb[e.name])
    assert names[:30] == ["fast"] * 30
    assert 3 <= names.count("slow") <= 8, names
    assert policy.avoided >= 30


def test_the_picks_of_a_burst_see_each_other(monkeypatch: pytest.MonkeyPatch) -> None:
    """A burst of new requests arrives within milliseconds while finished streams' slots are
    refilled (loads flat) and no leg has started yet (each upstream request is sent after an
    await): the endpoint expected a little sooner must not get the whole burst. A pick whose
    leg never starts (refused, or not streamed) stops counting after PICK_LAPSE_S."""
    # A lapse long enough that a pause of a busy machine inside this test cannot end it;
    # `pending` reads the module's value at each call.
    monkeypatch.setattr(_latency, "PICK_LAPSE_S", 5.0)
    policy = LatencyAware()
    a, b = _ep("a", inflight=50), _ep("b", inflight=50)
    _feed(a, 0.030, ttfb=0.060)
    _feed(b, 0.030, ttfb=0.066)  # 10 % slower than a
    s = LatencySettings()
    before = a.latency.expected(time.monotonic(), None, s)
    assert before == pytest.approx(0.060, rel=0.02)
    burst = []
    for _ in range(8):
        e = policy.pick([a, b], REQ)
        assert e is not None
        burst.append(e.name)
    assert burst[0] == "a"
    assert 2 <= burst.count("b") <= 4, burst
    n = burst.count("a")
    now = time.monotonic()
    assert a.latency.pending(now) == n
    assert a.latency.as_dict(now)["pending"] == n and a.latency.as_dict(now)["awaiting_first"] == 0
    assert a.latency.expected(now, None, s) == pytest.approx(0.060 * (1 + n / 16), rel=0.02)
    # A started leg takes its pick's place: counted once, not twice.
    a.relays.add(object())
    assert a.latency.pending(time.monotonic()) == n
    later = time.monotonic() + _latency.PICK_LAPSE_S + 0.01
    assert a.latency.pending(later) == 1 and b.latency.pending(later) == 0


def test_a_legs_own_prefill_does_not_make_its_endpoint_look_slow() -> None:
    """A cache-aware pick sends a prompt to a replica that does not hold it: its first event
    comes after its own prefill (40 ms here). The cache-aware score adds the uncached prefill
    of each new request itself, so the first-event time a new request expects there is the
    rest (the step it waited for); counting the prefill too made a replica that had just
    taken a miss look slow for every prompt it does hold. Without an own prefill (any other
    policy), all of it counts."""
    s = LatencySettings()

    def replica(own: float) -> EndpointLatency:
        lat = EndpointLatency(s)
        leg = object()
        lat.leg_started(leg, now=100.0, own_prefill_s=own)
        lat.first_event(leg, 0.012 + 0.040, now=100.052)
        return lat

    told, untold = replica(0.040), replica(0.0)
    assert told.ttfb_s == pytest.approx(0.012, abs=0.001)
    assert untold.ttfb_s == pytest.approx(0.052, abs=0.001)
    # A leg that ends without a first event leaves nothing behind.
    gone = object()
    told.leg_started(gone, now=101.0, own_prefill_s=0.04)
    told.leg_ended(gone)
    assert not told.waiting and not told._own


def test_the_cache_aware_pick_tells_the_leg_its_own_prefill() -> None:
    """What the chosen replica was not credited with is the leg's own prefill, at the
    policy's cost per token: a prompt it holds brings none, one it does not brings all."""
    policy = CacheAware()
    a, b = _ep("a"), _ep("b")
    text = "word " * 2000
    hint = hint_of({"prompt": text}, False, "m", block_chars=64, session=None)
    req = PickRequest("m", "standard", hint)
    first = policy.pick([a, b], req)
    assert first is not None
    policy.on_admit(first, req)
    assert hint.own_s == pytest.approx(len(text) / CHARS_PER_TOKEN * 40e-6, rel=0.01)
    # The relay's leg carries the hint: its start hands the endpoint that prefill, its
    # end forgets it.
    leg = type("Leg", (), {"hint": hint})()
    first.relays.add(leg)
    assert first.latency._own[id(leg)] == hint.own_s
    first.relays.discard(leg)
    assert id(leg) not in first.latency._own
    again = policy.pick([a, b], req)
    assert again is first
    policy.on_admit(again, req)
    assert hint.own_s < 0.001


def test_a_pick_over_two_pools_that_keeps_the_first_credits_what_it_holds() -> None:
    """`pick_route` scores the first pool, then (weighing a spill) a later one, and keeps the
    first pool's choice: the leg's own prefill is what that choice holds, not what the later
    pool's candidate would have (once the later pool's scoring replaced the credits, a
    prompt held in full was taken for a miss)."""
    policy = CacheAware(LatencySettings(slo_min_load=1.0))
    a, b = _ep("a", pool="fp16", inflight=4), _ep("b", pool="fp8", inflight=4)
    text = "word " * 2000
    hint = hint_of({"prompt": text}, False, "m", block_chars=64, session=None)
    req = PickRequest("m", "standard", hint)
    policy.on_admit(a, req)  # a holds the prompt
    before = policy.hit_blocks
    chosen = policy.pick_route([[a], [b]], req, fresh=True)
    assert chosen is a
    assert "b" in hint.cached  # the later pool was scored
    policy.on_admit(chosen, req)
    assert policy.hit_blocks - before == len(hint.blocks)
    assert hint.own_s < 0.001


def test_legs_waiting_for_their_first_event_count() -> None:
    """A burst of legs sent to an endpoint (a prefill backlog) makes it look slower at once,
    before any of them has answered; the backlog ends as their first events arrive."""
    s = LatencySettings()
    a = _ep("a")
    _feed(a, 0.02, ttfb=0.05)
    now = time.monotonic()
    base = a.latency.expected(now, None, s)
    assert base is not None and base == pytest.approx(0.05, rel=0.01)
    legs = [object() for _ in range(32)]
    for leg in legs:
        a.relays.add(leg)
    busy = a.latency.expected(time.monotonic(), None, s)
    assert busy is not None and busy > 2.5 * base  # x (1 + 32 / 16)
    for leg in legs:
        a.observe_first(leg, 0.05)
        a.relays.discard(leg)
    assert a.latency.waiting == {}
    # A leg still waiting long past the usual first-event time raises the estimate itself.
    stuck = object()
    a.latency.leg_started(stuck, time.monotonic() - 1.0)
    late = a.latency.expected(time.monotonic(), None, s)
    assert late is not None and late >= 1.0


def test_a_stale_estimate_fades() -> None:
    """An endpoint avoided for being slow gets no new first events (and, once its streams
    end, no gaps): what it showed fades after `stale_s`, so it is tried again rather than
    starved for good."""
    s = LatencySettings(stale_s=1.0)
    a = EndpointLatency(s)
    a.gap(0.2, now=99.9)
    a.gap(0.2, now=100.0)  # a window closed: its mean counts
    fresh = a.expected(100.0, 0.05, s)
    later = a.expected(103.0, 0.05, s)
    assert fresh == pytest.approx(0.4)
    assert later is not None and later < 0.08


def test_an_endpoint_slowing_down_counts_more_than_one_slow_all_along() -> None:
    """One endpoint has run at 30 ms gaps for seconds; another ran at 20 ms until 0.3 s ago
    and at 40 ms since (the onset of contention). Beyond their gaps' ratio, the one slowing
    down is expected to be slower still (its gap's rise over its own slow average counts
    squared); the steady one is weighed by its gap alone, and a rise within `rise_min` is
    noise and counts for nothing."""
    s = LatencySettings()
    steady, rising, noisy = EndpointLatency(s), EndpointLatency(s), EndpointLatency(s)
    _gaps(steady, 0.030, 90.0, 100.3)
    _gaps(rising, 0.020, 90.0, 100.0)
    _gaps(rising, 0.040, 100.0, 100.3)
    _gaps(noisy, 0.020, 90.0, 100.0)
    _gaps(noisy, 0.021, 100.0, 100.3)
    now = 100.3
    assert rising.gap_s is not None and steady.gap_s is not None
    assert rising.gap_s == pytest.approx(steady.gap_s, rel=0.35)
    assert rising.rise(s) > 1.2
    assert steady.rise(s) == 1.0 and noisy.rise(s) == 1.0
    e_steady, e_rising = steady.expected(now, None, s), rising.expected(now, None, s)
    assert e_steady is not None and e_rising is not None
    assert e_rising > 1.4 * e_steady * (rising.gap_s / steady.gap_s)
    assert noisy.expected(now, None, s) == pytest.approx(2 * noisy.gap_s)  # type: ignore[operator]
    # Seconds later the slow average has caught up: the rise no longer counts.
    _gaps(rising, 0.040, 100.3, 110.0)
    assert rising.rise(s) == 1.0


def test_a_step_long_for_a_prefill_is_no_rise_two_windows_of_them_are() -> None:
    """A step that takes a 1,000-token prompt's prefill (~40 ms on a 10 ms decode step)
    lengthens one averaging window's gaps: no slowdown, and read as one (the rise counts
    squared) it sent a shared prompt's next requests to replicas without it, whose own
    prefills then read as rises too (benchmarks/routing.py, shared-prefix). Such a window
    rises only as far as the window before it: a lone one is no rise; two running (a burst
    of prefills) are; and a long step no known prefill explains (a slowdown's) counts at
    once, as before."""
    s = LatencySettings(prefill_s_per_token=40e-6)

    def long_step(e: EndpointLatency, at: float, prefill: bool, first_last: bool = False) -> None:
        # The step's events come together, the prefilled leg's first event among them:
        # before the others' gaps (in the window before theirs when a gap opens a window)
        # or after them (in theirs).
        leg = object()
        if prefill:
            e.leg_started(leg, now=at - 0.045, prefill_tokens=1000)
            if not first_last:
                e.first_event(leg, 0.045, now=at)
        for k in range(4):  # four streams see the 50 ms step
            e.gap(0.050, now=at + k * 1e-4)
        if prefill and first_last:
            e.first_event(leg, 0.045, now=at + 5e-4)

    once, after, twice, unexplained = (EndpointLatency(s) for _ in range(4))
    for e in (once, after, twice, unexplained):
        _gaps(e, 0.010, 90.0, 100.0)
        live = object()  # a stream past its first event
        e.leg_started(live, now=89.0)
        e.first_event(live, 0.01, now=89.01)
        long_step(e, 100.05, prefill=e is not unexplained, first_last=e is after)
        _gaps(e, 0.010, 100.06, 100.1)
    long_step(twice, 100.15, prefill=True)
    _gaps(twice, 0.010, 100.16, 100.22)
    for e in (once, after, unexplained):
        _gaps(e, 0.010, 100.1, 100.22)
    for e in (once, after, twice, unexplained):
        assert e.gap_s is not None and e.gap_slow_s is not None
        assert e.gap_s > 1.2 * e.gap_slow_s  # the smoothed gap shows the long step(s) ...
    assert once.rise(s) == 1.0  # ... a lone prefill's is no rise
    assert after.rise(s) == 1.0  # ... whichever window its first event fell in
    assert twice.rise(s) > 1.2  # two windows running with one are
    assert unexplained.rise(s) > 1.2  # nor is a long step no prefill explains discounted


def test_a_late_step_counts_before_any_slow_gap_is_measured() -> None:
    """Streams have seen 30 ms steps for seconds; then nothing for 60 ms (the step in
    progress is twice its usual length: a slowdown's first step, whose gap no window has
    measured yet). That silence counts at once, as a rise; 40 ms of it (within `late_ratio`)
    is an ordinary step, and a silence with no stream past its first event (nothing to hear
    from) is none."""
    s = LatencySettings()
    e, quiet = EndpointLatency(s), EndpointLatency(s)
    _gaps(e, 0.030, 90.0, 100.0)
    _gaps(quiet, 0.030, 90.0, 100.0)
    leg = object()
    e.leg_started(leg, now=99.0)
    e.first_event(leg, 0.05, now=99.05)
    e.gap(0.030, now=100.0)
    assert e.late(100.04, s) == 1.0
    steady = e.expected(100.04, None, s)
    assert e.late(100.06, s) == pytest.approx(2.0, rel=0.05)
    late = e.expected(100.06, None, s)
    assert steady is not None and late is not None
    assert late > 3.5 * steady  # the 60 ms step as the gap, its 2x rise counted squared
    assert quiet.late(100.06, s) == 1.0  # no live stream: silence says nothing
    e.leg_ended(leg)
    assert e.late(100.06, s) == 1.0
    # A silence shorter than `floor_s` is jitter however short the steps (a fast engine).
    fast = EndpointLatency(s)
    _gaps(fast, 0.002, 90.0, 100.0)
    fast.leg_started(leg, now=99.0)
    fast.first_event(leg, 0.01, now=99.01)
    fast.gap(0.002, now=100.0)
    assert fast.late(100.015, s) == 1.0
    assert fast.late(100.03, s) > 1.0


def test_a_leg_waiting_on_a_late_endpoint_is_rerouted_only_to_a_much_faster_one() -> None:
    """`reroute`: only when the leg's endpoint is late, and the route's first pool expects a
    first token `reroute_ratio` times sooner; never when the others are as late (a slowdown of
    the whole machine), nor when the policy is told not to."""
    s = LatencySettings()
    policy = LatencyAware(s)
    slow, fast, also = _ep("slow", inflight=8), _ep("fast", inflight=8), _ep("also", inflight=8)
    _streaming(slow, fast, also)
    now = time.monotonic()
    assert not policy.reroute(slow, [fast], REQ)  # nothing late yet
    for e in (slow, also):
        e.latency.last_at = now - 0.1  # 100 ms without an event: > 3x the 30 ms steps
    assert policy.reroute(slow, [fast], REQ)
    assert not policy.reroute(slow, [also], REQ)  # as late as it is
    assert not policy.reroute(slow, [], REQ)  # nowhere to go
    assert not LatencyAware(LatencySettings(reroute_ratio=None)).reroute(slow, [fast], REQ)


def test_late_in_says_when_the_step_in_progress_would_turn_late() -> None:
    """The gateway's watch over waiting legs is armed for this moment, not every 10 ms: its
    wake-ups alone cost 1.04x the CPU per relayed chunk (benchmarks/relay_ab.py)."""
    s = LatencySettings()
    e = _ep("e", inflight=8)
    assert e.latency.late_in(time.monotonic(), s) is None  # nothing measured yet
    _streaming(e)
    lat, now = e.latency, time.monotonic()
    slow = lat.gap_slow_s
    assert slow is not None
    threshold = max(s.late_ratio * slow, s.floor_s)
    lat.last_at = now
    assert lat.late_in(now, s) == pytest.approx(threshold)
    assert lat.late(now + threshold * 0.99, s) == 1.0  # not late before it
    assert lat.late(now + threshold * 1.01, s) > 1.0  # late just after it
    assert lat.late_in(now + 2 * threshold, s) == 0.0


def test_a_step_taking_a_long_prefill_is_not_late_until_that_prefill_is_allowed_for() -> None:
    """The step in progress takes the legs sent before its latest event that wait for their
    first: their prompt tokens lengthen it (40 us each here), which is no slowdown. Read as a
    late step, a 1,000-token prompt's prefill multiplied the endpoint's expected first token by
    its rise squared and sent the prompt's next requests to replicas without its prefix
    (benchmarks/routing.py, shared-prefix, docs/bench.md). A leg sent after the latest event
    waits for the next step and adds nothing; one that had its first event or ended adds
    nothing either."""
    s = LatencySettings(prefill_s_per_token=40e-6)
    e = EndpointLatency(s)
    _gaps(e, 0.010, 90.0, 100.0)
    live = object()
    e.leg_started(live, now=99.0)
    e.first_event(live, 0.02, now=99.02)
    e.gap(0.010, now=100.0)
    slow = e.gap_slow_s
    assert slow is not None
    base = max(s.late_ratio * slow, s.floor_s)
    assert e.late_in(100.0, s) == pytest.approx(base)
    big, behind = object(), object()
    e.leg_started(big, now=99.995, prefill_tokens=1000)  # in the step in progress
    e.leg_started(behind, now=100.001, prefill_tokens=1000)  # after its latest event
    assert e.late_in(100.0, s) == pytest.approx(base + 0.040)
    assert e.late(100.0 + base + 0.030, s) == 1.0  # 30 ms into the prefill: not late
    steady = e.expected(100.0 + base + 0.030, None, s)
    assert e.late(100.0 + base + 0.050, s) > 1.0  # past it: late
    late = e.expected(100.0 + base + 0.050, None, s)
    assert steady is not None and late is not None and late > 4 * steady
    e.first_event(big, 0.05, now=100.05)  # its first token: the next step's legs count now
    assert e.late_in(100.05, s) == pytest.approx(base + 0.040)  # `behind`'s prefill
    e.leg_ended(behind)
    assert e.late_in(100.05, s) == pytest.approx(base)


def test_a_legs_prefill_is_its_whole_prompt() -> None:
    """`Endpoint.relays` tells the latency what a leg may bring to the step that takes it: its
    whole prompt (`RouteHint.chars`, 4 characters a token), not the part the prefix index
    credited the endpoint with (the index is approximate: an engine that evicted a credited
    prefix prefills it all); nothing without a hint."""
    from unbroken.gateway._prefix import RouteHint

    e = _ep("e", inflight=1)
    hint = RouteHint(blocks=list(range(63)), chars=4032, session=None, block_chars=64)
    hint.cached = {"e": 50}

    class Leg:
        def __init__(self, hint: RouteHint | None) -> None:
            self.hint = hint

    with_hint, without = Leg(hint), Leg(None)
    e.relays.add(with_hint)
    e.relays.add(without)
    got = e.latency._prefill
    assert got == {id(with_hint): 4032 / 4}
    e.relays.discard(with_hint)
    assert got == {}


def test_only_legs_sent_after_the_latest_event_wait_behind_the_step_in_progress() -> None:
    """A leg sent before an endpoint's latest event is in the step that began then (the
    engine takes what has arrived at each step's start): a long step is often its very
    prefill, and a re-send would lose that place. One sent after it waits for the next step."""
    lat = EndpointLatency()
    t = 100.0
    early, late, done = object(), object(), object()
    lat.leg_started(early, now=t)
    lat.leg_started(done, now=t)
    lat.first_event(done, 0.01, now=t + 0.01)  # the step boundary: latest event at t + 0.01
    lat.leg_started(late, now=t + 0.02)
    assert not lat.behind(early)
    assert lat.behind(late)
    assert not lat.behind(done)  # not waiting
    lat.gap(0.03, now=t + 0.04)  # the next step's events: `late` is in that one now
    assert not lat.behind(late)


def test_no_reroute_to_an_endpoint_stalled_since_the_late_one_went_late() -> None:
    """A host-wide stall (a neighbour's weight read): every engine stops at once, and each is
    seen late a little after the other. The one whose last event came 20 ms later is not late
    yet by its own measure (the first is, at 2.3x the 30 ms steps' average), but it has shown
    nothing since the first went late: moving there loses the place in the queue and gains
    nothing (the rollout window's 177-183 ms TTFTs in a demo). Once it shows an event, or where
    nothing is under way, it is a target."""
    s = LatencySettings()
    policy = LatencyAware(s)
    first, second, idle = _ep("first", inflight=8), _ep("second", inflight=8), _ep("idle")
    _streaming(first, second)
    _feed(idle, 0.03, ttfb=0.06)  # measured once, no stream under way now
    now = time.monotonic()
    first.latency.last_at = now - 0.07
    second.latency.last_at = now - 0.05  # not late yet by its own measure: 50 < 1.5 x 30 ms
    assert not policy.reroute(first, [second], REQ)
    second.latency.last_at = now - 0.02  # it moved again, after first went late
    assert policy.reroute(first, [second], REQ)
    second.latency.last_at = now - 0.05
    assert policy.reroute(first, [second, idle], REQ)  # nothing under way: a fresh step


def test_a_waiting_leg_is_rerouted_only_within_its_own_pool() -> None:
    """A late step is transient: a waiting leg moves to a faster replica of its own pool,
    never to another tier (fp16 to fp8, the route's next pool), and a pool of one keeps it.
    Real vLLM on CPU makes long prefill steps: without this, a second stream sent to the only
    primary went to the fallback server (tests/vllm/test_vllm_gateway.py's premise)."""
    pool = Pool(default_cap=100)
    a, f = _ep("a", "primary", inflight=8), _ep("f", "fallback", inflight=8)
    for e in (a, f):
        pool.add(e)
    _streaming(a, f)
    pool.routes = {"standard": ["primary", "fallback"]}
    a.latency.last_at = time.monotonic() - 0.1  # late: > 3x its 30 ms steps
    assert not pool.reroute(a, "m", "standard", [])  # only the fallback is faster
    c = _ep("c", "primary", inflight=8)
    pool.add(c)
    _streaming(c)
    assert pool.reroute(a, "m", "standard", [])  # a faster replica of its own pool


def test_a_waiting_leg_is_never_rerouted_to_a_contended_replica() -> None:
    """A late step is transient, a contended device slow for its whole episode: a leg waiting
    on a late healthy replica stays rather than move onto it (the controller's contention test
    saw critical streams land on the contended replica on CI's busy cores). One waiting on the
    contended replica may still move to its healthy sibling."""
    pool = Pool(default_cap=100)
    a, b = _ep("a", "primary", inflight=8), _ep("b", "primary", inflight=8)
    for e in (a, b):
        pool.add(e)
    _streaming(a, b)
    a.latency.last_at = time.monotonic() - 0.1  # late: > 3x its 30 ms steps
    assert pool.reroute(a, "m", "standard", [])  # b is healthy and much sooner
    b.set_condition("contended")
    assert not pool.reroute(a, "m", "standard", [])
    b.set_condition("normal")
    a.set_condition("contended")
    assert pool.reroute(a, "m", "standard", [])


def test_spill_to_a_later_pool_only_for_new_requests_and_only_when_much_slower() -> None:
    pool = Pool(default_cap=100)
    f, p = _ep("f", "fallback", inflight=2), _ep("p", "primary", inflight=2)
    for e in (f, p):
        pool.add(e)
        _feed(e, 0.03, ttfb=0.08)
    pool.routes = {"standard": ["fallback", "primary"]}
    assert pool.pick("m", "standard") is f  # the same speed: the route's order
    _feed(f, 0.05)  # somewhat slower: still under spill_ratio
    assert pool.pick("m", "standard") is f
    _feed(p, 0.01, ttfb=0.02)  # the later pool much faster, but f has no backlog: kept
    assert pool.pick("m", "standard") is f
    for _ in range(16):  # a burst of continuations lands on f: a prefill backlog
        f.relays.add(object())
    assert pool.pick("m", "standard") is p  # a new request goes past it
    assert pool.policy.spills == 1  # type: ignore[attr-defined]
    # A continuation or a retry (it excludes where it was) keeps to the route's order.
    other = _ep("x", "primary")
    assert pool.pick("m", "standard", exclude=[other]) is f


def test_contended_endpoint_stays_last_within_its_pool() -> None:
    pool = Pool(default_cap=100)
    a, b = _ep("a", inflight=0), _ep("b", inflight=50)
    for e in (a, b):
        pool.add(e)
        _feed(e, 0.02)
    a.set_condition("contended")
    assert pool.pick("m", "standard") is b


# -- real processes -----------------------------------------------------------------------------
class _Streams:
    """`n` long greedy streams read at full speed, restarted as they end."""

    def __init__(self, url: str, n: int, max_tokens: int = 1500) -> None:
        self.url, self.n, self.max_tokens = url, n, max_tokens
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(n)]
        self.errors: list[str] = []

    def __enter__(self) -> _Streams:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)

    def _run(self, i: int) -> None:
        body = {"model": MODEL, "prompt": f"long stream {i}", "max_tokens": self.max_tokens,
                "temperature": 0, "stream": True}  # fmt: skip
        while not self._stop.is_set():
            try:
                with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=60) as r:
                    for _ in r.iter_raw():
                        if self._stop.is_set():
                            break
                    if r.status_code != 200:
                        self.errors.append(f"HTTP {r.status_code}")
            except httpx.HTTPError as e:
                self.errors.append(repr(e))


def _probe(url: str) -> str:
    """One short streaming request (20 tokens: a few overlap, so least load alternates
    between equal replicas); the endpoint that served it."""
    body = {"model": MODEL, "prompt": "where", "max_tokens": 20, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        r.read()
        assert r.status_code == 200, r.status_code
        return r.headers["x-unbroken-endpoint"]


def _probes(url: str, seconds: float, every: float = 0.025) -> list[tuple[float, str]]:
    """Probes sent every `every` s for `seconds`, each in its own thread (an open loop): the
    time each was sent and the endpoint that served it."""
    out: list[tuple[float, str]] = []
    threads = []
    t0 = time.monotonic()

    def one() -> None:
        t = time.monotonic() - t0
        out.append((t, _probe(url)))

    while time.monotonic() - t0 < seconds:
        th = threading.Thread(target=one)
        th.start()
        threads.append(th)
        time.sleep(every)
    for th in threads:
        th.join(30)
    return sorted(out)


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[Proc, Proc, Proc, dict[str, str]]]:
    """Two replicas of one pool behind a gateway (no controller), names by URL."""
    a = engine(tmp_path, name="a")
    b = engine(tmp_path, name="b")
    g = gateway(tmp_path, a.url, b.url)
    names = {e["url"]: e["name"] for e in admin(g, "GET", "/admin/endpoints").json()["endpoints"]}
    yield g, a, b, names
    for p in (g, a, b):
        p.stop()


def _routing(g: Proc) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in admin(g, "GET", "/admin/endpoints").json()["endpoints"]}


def test_a_replica_slowed_mid_run_gets_no_new_requests_within_a_quarter_second(
    pair: tuple[Proc, Proc, Proc, dict[str, str]],
) -> None:
    """Contention on one replica (its decode steps ~10x longer), no controller: from 250 ms
    after the onset (a few of its steps) to 1 s no new request goes to it (measured: none in 4
    runs), while with least load alone it kept getting 4-6 of the ~50 probes sent from 0.25 to
    1.5 s."""
    g, a, b, names = pair
    slow = names[a.url]
    with _Streams(g.url, 8) as load:
        wait_for(lambda: all(e["inflight"] >= 3 for e in _routing(g).values()), timeout=10)
        time.sleep(2.5)  # the streams' first events (a cold start) are older than stale_s
        before = _probes(g.url, 0.5)
        r = httpx.post(
            a.url + "/admin/faults",
            json={"kind": "slow_cuda", "extra_ms": 15, "duration_s": 20},
            headers=AUTH,
        )
        assert r.status_code == 200, r.text
        after = _probes(g.url, 1.5)
        view = _routing(g)
    assert not load.errors, load.errors[:3]
    share_before = sum(n == slow for _, n in before) / len(before)
    assert 0.2 <= share_before <= 0.8, before
    # From 250 ms to stale_s (1 s) after the onset. Later, the slowed replica's first-event
    # time (sampled last before the onset: no new leg went there) fades by design so that an
    # avoided endpoint is tried again, and on a loaded machine its still-measured 10x gap can
    # then cost less than the other replica's queue: CI (2026-12-05) picked it at 1.32 and
    # 1.38 s and never before, which is the retry, not a missed slowdown.
    late = [n for t, n in after if 0.25 <= t < 1.0]
    # Compact, so that a failure shows when each pick of the slowed replica came (pytest cuts
    # a long list): one full-suite run on a loaded machine had 4 (2026-12-05, not reproduced
    # in 8 runs alone, under two busy loops, or beside another file's real processes).
    slow_at = [round(t, 3) for t, n in after if n == slow]
    assert late and late.count(slow) <= 1, (len(after), slow_at, view[slow]["routing"])
    # The listing shows why: the slowed replica's steps and expected first-token time.
    ra, rb = view[slow]["routing"], view[names[b.url]]["routing"]
    assert ra["gap_ms"] > 3 * rb["gap_ms"], (ra, rb)
    assert ra["expected_ttft_ms"] > 3 * rb["expected_ttft_ms"], (ra, rb)


def _first_token(url: str) -> tuple[str, float]:
    """One short streaming request: the endpoint that served it, and when its first token
    came (monotonic)."""
    body = {"model": MODEL, "prompt": "now", "max_tokens": 4, "temperature": 0, "stream": True}
    first = -1.0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200, r.status_code
        for line in r.iter_lines():
            if line.startswith("data: {") and first < 0:
                first = time.monotonic()
        return r.headers["x-unbroken-endpoint"], first


@dataclass
class _StuckA:
    """Two replicas with 20 ms decode steps and four long streams each; B full (cap 0) and
    A stuck (the `hang` fault: no tokens, /health fine), eight new streams (threads running
    `one`) waiting for their first token on A. `stuck` is when A's hang began."""

    g: Proc
    a: Proc
    b: Proc
    na: str
    nb: str
    threads: list[threading.Thread]
    stuck: float


@contextlib.contextmanager
def _eight_waiting_on_a_stuck_replica(
    tmp_path: Path, hang_s: float, one: Callable[[str], None]
) -> Iterator[_StuckA]:
    a = engine(tmp_path, name="a", fast=False)
    b = engine(tmp_path, name="b", fast=False)
    g = gateway(tmp_path, a.url, b.url)
    names = {e["url"]: e["name"] for e in admin(g, "GET", "/admin/endpoints").json()["endpoints"]}
    na, nb = names[a.url], names[b.url]
    try:
        with _Streams(g.url, 8, max_tokens=4000) as load:
            wait_for(lambda: all(e["inflight"] >= 3 for e in _routing(g).values()), timeout=10)
            time.sleep(1.0)
            admin(g, "PATCH", f"/admin/endpoints/{nb}", {"cap": 0})
            r = httpx.post(
                a.url + "/admin/faults", json={"kind": "hang", "duration_s": hang_s}, headers=AUTH
            )
            assert r.status_code == 200, r.text
            stuck = time.monotonic()
            threads = [threading.Thread(target=one, args=(g.url,)) for _ in range(8)]
            for t in threads:
                t.start()
            wait_for(
                lambda: _routing(g)[na]["routing"]["awaiting_first"] >= 8,
                timeout=5,
                interval=0.005,
                what="eight new streams waiting on A",
            )
            yield _StuckA(g, a, b, na, nb, threads, stuck)
            for t in threads:
                t.join(30)
        # The long streams on the stuck replica are not these tests' concern: the stall rule
        # continues them elsewhere after its own limit.
        del load
    finally:
        for p in (g, a, b):
            p.stop()


def test_streams_waiting_on_a_replica_that_stops_are_resent_at_once(tmp_path: Path) -> None:
    """Replica A stops producing tokens while B is full, so eight new streams can only be
    admitted to A, where they wait for a first token (`_eight_waiting_on_a_stuck_replica`).
    The moment B has room again, each is re-sent there (`late_first` retries: nothing had
    reached its client): every first token within 0.5 s of B opening. Without it they waited
    out the hang (measured: 5.2 s) or the first-byte rule."""
    results: list[tuple[str, float]] = []
    with _eight_waiting_on_a_stuck_replica(
        tmp_path, 5, lambda url: results.append(_first_token(url))
    ) as s:
        opened = time.monotonic()
        admin(s.g, "PATCH", f"/admin/endpoints/{s.nb}", {"cap": None})
        for t in s.threads:
            t.join(30)
        moved = metric(s.g.url, "unbroken_gateway_retries_total", reason="late_first")
    assert len(results) == 8
    assert all(n == s.nb for n, _ in results), results
    assert max(t - opened for _, t in results) < 0.5, [t - opened for _, t in results]
    assert moved == 8


def test_a_stream_moved_for_a_late_step_is_moved_again_not_failed(tmp_path: Path) -> None:
    """As above, eight new streams wait on a stuck replica A and are re-sent to B when B opens;
    but B sticks too, just before they reach it, and A recovers first. A move for a late
    step is no failure of the endpoint: the streams move back to A (`late_first` twice each)
    and get their first tokens there once A runs again (1.57 s after A's hang began, in 6
    runs), long before B's 5 s are over. Before
    (2026-12-05) each move counted as a failed attempt and excluded its endpoint, so the
    second move left no endpoint to try: 502 "no endpoint could serve the request" with both
    engines healthy (seen in benchmarks/routing.py's shared-prefix passes and once in this
    file's quarter-second test)."""
    results: list[tuple[str, float]] = []
    errors: list[str] = []

    def one(url: str) -> None:
        try:
            results.append(_first_token(url))
        except AssertionError as e:  # a status other than 200
            errors.append(str(e))

    with _eight_waiting_on_a_stuck_replica(tmp_path, 1.5, one) as s:
        r = httpx.post(
            s.b.url + "/admin/faults", json={"kind": "hang", "duration_s": 5}, headers=AUTH
        )
        assert r.status_code == 200, r.text
        b_stuck = time.monotonic()
        # Opened once B's last step has ended (it reads late, and 50 ms more for a slow last
        # step's events), so that the streams moved there wait behind its step in progress,
        # not in it (a leg in the step in progress is never moved: 1 run in 7 had them there).
        wait_for(
            lambda: _routing(s.g)[s.nb]["routing"]["late"] > 1.0,
            timeout=5,
            interval=0.005,
            what="B late",
        )
        time.sleep(0.05)
        admin(s.g, "PATCH", f"/admin/endpoints/{s.nb}", {"cap": None})
        for t in s.threads:
            t.join(30)
        moved = metric(s.g.url, "unbroken_gateway_retries_total", reason="late_first")
    assert not errors, errors
    assert len(results) == 8
    assert all(n == s.na for n, _ in results), (
        moved,
        [round(t - s.stuck, 2) for _, t in results],
        results,
    )
    # After A's hang (1.5 s) and before the end of B's (5 s from b_stuck).
    firsts = [round(t - s.stuck, 2) for _, t in results]
    assert min(firsts) > 1.4 and max(t for _, t in results) < b_stuck + 4.8, firsts
    assert moved == 16


def test_slow_clients_alone_never_change_routing(tmp_path: Path) -> None:
    """Six clients that stop reading, all on replica B; six streams read at full speed on A
    (20 ms decode steps: the measured latency is above the policy's floor, so it would weigh).
    The gateway still reads B at engine speed (it buffers for the slow clients), so B's gaps
    and first-event times, and so its expected first-token time, stay those of A: the policy
    weighs the two alike and new requests go where least load sends them."""
    a = engine(tmp_path, name="a", fast=False)
    b = engine(tmp_path, name="b", fast=False)
    g = gateway(tmp_path, a.url, b.url)
    names = {e["url"]: e["name"] for e in admin(g, "GET", "/admin/endpoints").json()["endpoints"]}
    na, nb = names[a.url], names[b.url]
    socks: list[socket.socket] = []
    body = json.dumps(
        {"model": MODEL, "prompt": "never read", "max_tokens": 4000, "stream": True}
    ).encode()
    try:
        admin(g, "PATCH", f"/admin/endpoints/{na}", {"cap": 0})
        for _ in range(6):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", g.port))
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                + f"\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            socks.append(s)
        wait_for(lambda: _routing(g)[nb]["inflight"] >= 6, timeout=10, what="slow streams on B")
        admin(g, "PATCH", f"/admin/endpoints/{na}", {"cap": None})
        admin(g, "PATCH", f"/admin/endpoints/{nb}", {"cap": 0})
        with _Streams(g.url, 6, max_tokens=4000) as load:
            wait_for(lambda: _routing(g)[na]["inflight"] >= 6, timeout=10, what="streams on A")
            admin(g, "PATCH", f"/admin/endpoints/{nb}", {"cap": None})
            wait_for(
                lambda: _routing(g)[nb]["slow_clients"] >= 4, timeout=30, what="slow clients on B"
            )
            views = []
            for _ in range(10):
                time.sleep(0.2)
                views.append(_routing(g))
            probes = _probes(g.url, 1.0, every=0.05)
        assert not load.errors, load.errors[:3]
    finally:
        for s in socks:
            s.close()
        for p in (g, a, b):
            p.stop()
    assert probes
    for view in views:
        ra, rb = view[na]["routing"], view[nb]["routing"]
        assert view[na]["slow_clients"] == 0 and view[nb]["slow_clients"] >= 4, view
        assert 15 < ra["gap_ms"] < 40 and 15 < rb["gap_ms"] < 40, (ra, rb)  # 20 ms steps
        assert rb["gap_ms"] < 1.3 * ra["gap_ms"], (ra, rb)
        assert rb["expected_ttft_ms"] < 1.3 * ra["expected_ttft_ms"], (ra, rb)
        assert rb["awaiting_first"] == 0, rb
