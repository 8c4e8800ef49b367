"""Admission: per-endpoint in-flight caps, a priority queue for requests over the caps, and
shedding.

A request takes slots on an endpoint (`acquire`) and gives them back (`release`): one slot
per sequence it makes the engine run (prompts times max(n, best_of)), never more than the
endpoint's cap, so a fan-out request weighs what it costs. When no endpoint allowed for its
priority has room, critical and standard requests wait (critical first) up to the queue
timeout; sheddable requests get 429 at once.

Within a priority, waiters are served by start-time fair queueing over tenants (issue 25):
each tenant's waiter gets a virtual start tag, max(the class's virtual time, the tenant's
previous tag + 1 / its weight), and the lowest tag goes first; the class's virtual time is
the tag of the last waiter served. So tenants of one priority take turns in proportion to
their weights, and a tenant arriving behind another's 500 waiters is next but one, not
501st. Requests without a tenant are one flow (FIFO, as before tenants existed). A tenant
whose waiters are all gone starts again at the class's virtual time (no credit, no debt).

Turns alone leave a tenant's request waiting for a slot to free when an over-share tenant
holds all of a pool; the reserve (`_fairshare`) keeps the pool's last slot(s) from a tenant
over its weighted share while another tenant of the priority is active there and under its
share, so that tenant's next request finds a slot at once. Slots taken for a tenant are an
int (`_Slots`) that carries its flow, so `release` un-counts the tenant with no new argument.

The queue is bounded by count and by the request bytes its waiters hold: beyond either, 429
at once.

With several worker processes (`shared`), slots live in the shared table: picking and taking
run under its lock, so together the workers never exceed a cap. Each worker queues its own
waiters; a new request does not pass one of equal or better priority waiting in any worker,
and waiters poll for slots that other workers free every `POLL_S`, leaving a slot for up to
`DEFER_S` to a better priority queued in another worker. Queue bounds (count, bytes) are per
worker.

Fair queueing holds across workers: a tenant's tags are on one clock for all of them (the
class's virtual time and each tenant's next tag are in `_fairshare`'s table, written under
the lock), a tenant with waiters in any worker queues behind them, and each worker publishes
its lowest tag waiting per priority and pool: a waiter leaves a free slot for up to `DEFER_S`
to a lower tag waiting in another worker, as to a better priority. Requests without a tenant
keep per-worker tags (FIFO per worker). One process keeps it all in process.

The waiter and the heap that orders waiters are `_admission_queue`'s; the reserve's table is
`_fairshare`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Final

from unbroken.gateway._admission_queue import _RANK, PRIORITIES, _Kind, _Waiter, in_order, remove
from unbroken.gateway._fairshare import RESERVE_WINDOW_S, FairShare
from unbroken.gateway._pool import Endpoint, Pool, State
from unbroken.gateway._prefix import RouteHint
from unbroken.wire.errors import ApiError

if TYPE_CHECKING:
    from unbroken.gateway._shared import SharedCounters

# `PRIORITIES`, `_RANK`, `_Kind` and `_Waiter` (now `_admission_queue`) were defined here
# before the split (issue 22) and are still importable from here.
__all__ = ["POLL_S", "PRIORITIES", "Admission"]

# How often queued requests look for slots freed by other workers.
POLL_S = 0.005
# How long a queued request leaves a freed slot to a better-priority request queued in another
# worker (which may need another pool or model, so not forever).
DEFER_S = 0.2
# Start tags closer than this (relative) are a tie: sums of 1 / weight round differently.
TAG_EPS = 1e-9
# Every endpoint that serves a model down (its /health probes fail) and none starting: a
# request waits this long after that was first seen (a replica that recovers in a probe or
# two serves it), then the answer is 503 `no_endpoint` at once, not a queue timeout's 429.
DEAD_GRACE_S = 3.0


class _Slots(int):
    """Slots taken for a tenant: the count callers add and give back, and the tenant's flow
    in the fair-share table (`release` un-counts it there)."""

    flow: int


class _HeldBack:
    """`_pick_take`'s answer when there is room, but it is the reserve of another tenant."""


HELD: Final = _HeldBack()


class Admission:
    def __init__(
        self,
        pool: Pool,
        *,
        queue_timeout: float,
        retry_after: int = 1,
        max_queue: int | None = None,
        max_queue_bytes: int | None = None,
        shared: SharedCounters | None = None,
    ) -> None:
        self.pool = pool
        self.shared = shared
        self._lock = shared.lock if shared is not None else contextlib.nullcontext
        self._poller: asyncio.Task[None] | None = None
        self.queue_timeout = queue_timeout
        self.retry_after = retry_after
        self.max_queue = max_queue
        self.max_queue_bytes = max_queue_bytes
        self._heap: list[_Waiter] = []
        self._seq = itertools.count()
        self.depth = dict.fromkeys(PRIORITIES, 0)
        self.queued_bytes = 0
        # This process's demand by pool (the autoscaling signal, `demand()`): slots it holds
        # on each pool's endpoints, and its waiters by the pool each would go to first.
        self.held: dict[str, int] = {}
        self.waiting: dict[str, int] = {}
        # Fair queueing (module doc): per priority the virtual time, per (priority, tenant)
        # the next start tag and how many of its waiters are queued.
        self._vtime = [0.0] * len(PRIORITIES)
        self._next: dict[tuple[int, str | None], float] = {}
        self._queued: dict[tuple[int, str | None], int] = {}
        # The reserve: each tenant's slots per pool, shared by the workers (made on the first
        # tenant request); a wake for when a tenant's reserve may have lapsed (one process:
        # with workers the poll does it).
        self._fair: FairShare | None = None
        # With workers, per low group (priority, pool; `_fairshare`) this worker's tenant
        # waiters by start tag, left ones popped lazily: its lowest, published to the others.
        self._lows: dict[int, list[_Waiter]] = {}
        # The kinds of waiters queued (model, priority, weight, tenant) and how many of each,
        # and how many waiters exclude endpoints: `wake` stops once every kind is blocked.
        self._kinds: dict[_Kind, int] = {}
        # When a pass last found no room for requests like these (model, priority, weight):
        # a deferring waiter's clock set before it is stale.
        self._full_at: dict[tuple[str, str, int], float] = {}
        # Per (model, priority): since when nothing could serve it (`_unserved`), and when
        # that was last seen.
        self._dead_at: dict[tuple[str, str], tuple[float, float]] = {}
        self._excluding = 0
        self._lapse: asyncio.TimerHandle | None = None

    def fair(self) -> FairShare:
        if self._fair is None:
            self._fair = FairShare(self.shared)
        return self._fair

    def _take(self, ep: Endpoint, weight: int, flow: int | None = None) -> tuple[Endpoint, int]:
        n = max(1, min(weight, ep.effective_cap(self.pool.default_cap)))
        ep.slot.add(n)
        ep.slot.serve()
        self.held[ep.pool] = self.held.get(ep.pool, 0) + n
        if flow is None:
            return ep, n
        assert self._fair is not None
        self._fair.add(flow, n)
        slots = _Slots(n)
        slots.flow = flow
        return ep, slots

    def _room(self, pool: str, model: str) -> tuple[int, int]:
        """A pool's capacity for `model` (its ready endpoints' caps) and its free slots."""
        cap = free = 0
        for e in self.pool.endpoints.values():
            if e.pool == pool and e.state == State.READY and e.healthy and model in e.models:
                c = e.effective_cap(self.pool.default_cap)
                cap += c
                free += max(0, c - e.inflight)
        return cap, free

    def _wants(self, model: str, priority: str) -> str | None:
        """The pool a queued request counts toward: the first of its priority's route that
        has an endpoint of its model in any state (a full pool is the one to grow)."""
        eps = list(self.pool.endpoints.values())
        route = self.pool.pools_for(priority)
        for name in route:
            if any(e.pool == name and model in e.models for e in eps):
                return name
        # No replica of it runs: the first pool of the route the spec gives it (a pool
        # autoscaled to 0, which this request's demand wakes).
        return next((n for n in route if model in self.pool.pool_models.get(n, ())), None)

    def _absent(self, model: str, priority: str) -> str | None:
        """ "asleep" when a pool of `priority`'s route is declared to serve `model`, no
        replica runs in any pool of the route (in any state), and one such pool may sleep
        (autoscaled with min 0: `Pool.sleeping`); "down" when none may (its replicas are
        crashing or being replaced: a review saw a crash loop called "scaled to zero");
        else None."""
        names = set(self.pool.pools_for(priority))
        if any(e.pool in names and model in e.models for e in self.pool.endpoints.values()):
            return None
        return self._unrun(model, priority)

    def _unrun(self, model: str, priority: str) -> str | None:
        """`_absent`'s verdict for a route none of whose replicas serves `model`."""
        route = self.pool.pools_for(priority)
        declared = [n for n in route if model in self.pool.pool_models.get(n, ())]
        if not declared:
            return None
        return "asleep" if self.pool.sleeping.intersection(declared) else "down"

    def _asleep(self, model: str, priority: str) -> bool:
        return self._absent(model, priority) == "asleep"

    def _unserved(self, model: str, priority: str, *, starting: bool) -> str | None:
        """Why nothing of `priority`'s route can serve `model` now, or None: the endpoints
        that serve it are all down (their /health probes fail) or leaving, and, with `starting`,
        no endpoint of the route is starting (a replacement that may serve it soon). None
        too when no endpoint serves it at all (asleep or unknown: said elsewhere). Said to
        clients without names or errors (the endpoints are internal; the log has them)."""
        route = set(self.pool.pools_for(priority))
        eps = [e for e in self.pool.endpoints.values() if e.pool in route and model in e.models]
        # Ready and not down: in rotation, or held out after a hang (tried again soon).
        if any(e.state == State.READY and not e.down for e in eps):
            return None
        if starting and any(
            e.pool in route and e.state in (State.STARTING, State.WARMING)
            for e in self.pool.endpoints.values()
        ):
            return None
        if not eps:
            # None at all: asleep (a pool autoscaled to 0), unknown (said elsewhere), or a
            # pool that does not sleep with no replica left (a crash loop between its
            # replacements, which a review saw answered "scaled to zero").
            if self._unrun(model, priority) != "down":  # (no endpoint serves it: known)
                return None
            return "no replica of its pool serves (starting, or being replaced after a crash)"
        down = sum(e.state == State.READY for e in eps)
        parts = [f"{down} down (not answering their health checks)"] if down else []
        if len(eps) > down:
            parts.append(f"{len(eps) - down} draining or gone")
        return f"its {len(eps)} replica(s) are " + " and ".join(parts)

    def _dead(self, model: str, priority: str) -> None:
        """503 when nothing has served `model` for DEAD_GRACE_S (`_unserved`): a client of
        a dead fleet learns it at once, not after the queue timeout as "at capacity"."""
        key = (model, priority)
        why = self._unserved(model, priority, starting=True)
        if why is None:
            self._dead_at.pop(key, None)
            return
        now = time.monotonic()
        since, seen = self._dead_at.get(key, (now, now))
        if now - seen > 3 * DEAD_GRACE_S:
            since = now  # not seen for a while (it may have served since): a new episode
        self._dead_at[key] = (since, now)
        if now - since >= DEAD_GRACE_S:
            raise _no_endpoint(model, why, self.retry_after)

    def demand(self) -> dict[str, int]:
        """Per pool, the sequences this process runs on it plus the requests it queues for
        it: what an autoscaler sizes the pool for (ceil(demand / target) replicas)."""
        out = {p: n for p, n in self.held.items() if n > 0}
        for p, n in self.waiting.items():
            if n > 0:
                out[p] = out.get(p, 0) + n
        return out

    def _pick_take(
        self,
        model: str,
        priority: str,
        exclude: tuple[Endpoint, ...],
        weight: int,
        hint: RouteHint | None = None,
        tenant: str | None = None,
        share: float = 1.0,
        vt: float | None = None,
    ) -> tuple[Endpoint, int] | _HeldBack | None:
        """Slots now, or None (no room), or HELD (room only in another tenant's reserve).
        `vt`: a waiter's start tag on the workers' shared clock, which its take advances."""
        # Full is known without the lock (waiters poll this often), and without the hint:
        # room does not need a cache-aware policy's arithmetic.
        if self.shared is not None and not self.pool.has_room(model, priority, exclude, weight):
            return None
        with self._lock():
            ep = self._pick(model, priority, exclude, weight, hint)
            if ep is None or tenant is None:
                return None if ep is None else self._take(ep, weight)
            fair, rank, now = self.fair(), _RANK[priority], time.monotonic()
            while True:
                i, active = fair.enter(rank, tenant, ep.pool, share, now)
                if active is None:  # alone there (or i None: the table is full, no reserve)
                    if vt is not None:
                        fair.served(rank, vt)
                    return self._take(ep, weight, i)
                n = max(1, min(weight, ep.effective_cap(self.pool.default_cap)))
                if not fair.holds_back(i, n, active, *self._room(ep.pool, model), now):
                    if vt is not None:
                        fair.served(rank, vt)
                    return self._take(ep, weight, i)
                # Another pool of the route may have room that nobody's reserve claims.
                gone = ep.pool
                exclude = (*exclude, *(e for e in self.pool.endpoints.values() if e.pool == gone))
                ep = self._pick(model, priority, exclude, weight, hint)
                if ep is None:
                    return HELD

    def _others_waiting(self, rank: int) -> bool:
        """Does another worker queue a request of priority `rank` or better?"""
        sh = self.shared
        if sh is None:
            return False
        return any(sh.queued(r) > self.depth[PRIORITIES[r]] for r in range(rank + 1))

    def _turn_elsewhere(self, rank: int, tenant: str) -> bool:
        """Workers: has `tenant` waiters of priority `rank` queued in another worker (so its
        next request's turn is after theirs, not now)?"""
        sh = self.shared
        if sh is None or sh.queued(rank) <= self.depth[PRIORITIES[rank]]:
            return False
        return self.fair().tenant_waiting(rank, tenant)

    def queue_depth(self) -> dict[str, int]:
        """Requests waiting, by priority: all workers' when shared."""
        if self.shared is None:
            return dict(self.depth)
        return {p: self.shared.queued(i) for i, p in enumerate(PRIORITIES)}

    def _publish(self) -> None:
        if self.shared is not None:
            for i, p in enumerate(PRIORITIES):
                self.shared.set_depth(i, self.depth[p])

    def _pick(
        self,
        model: str,
        priority: str,
        exclude: tuple[Endpoint, ...],
        weight: int,
        hint: RouteHint | None = None,
    ) -> Endpoint | None:
        """The pool's pick, among endpoints with room for `weight` sequences
        (`Endpoint.has_room`)."""
        if weight <= 1:
            return self.pool.pick(model, priority, exclude, hint)
        skip = list(exclude)
        while (ep := self.pool.pick(model, priority, skip, hint)) is not None:
            if ep.has_room(self.pool.default_cap, weight):
                return ep
            skip.append(ep)
        return None

    async def acquire(
        self,
        model: str,
        priority: str,
        exclude: Iterable[Endpoint] = (),
        *,
        weight: int = 1,
        size: int = 0,
        hint: RouteHint | None = None,
        tenant: str | None = None,
        share: float = 1.0,
    ) -> tuple[Endpoint, int, float]:
        """Slots on an endpoint: (endpoint, slots taken, seconds spent queued). `size` is
        what the request holds in memory while it waits (its body); `hint` what a
        cache-aware policy needs of its prompt; `tenant` and its weight `share` its turn
        among its priority's waiters (fair queueing)."""
        exclude = tuple(exclude)
        rank = _RANK[priority]
        flow = (rank, tenant)
        # Who goes first: waiters of a better priority, and of the same one unless this is a
        # tenant with none of its own waiting here or in another worker (its start tag would
        # be the class's virtual time, the lowest: fair queueing serves it next, so it may
        # take a free slot now).
        ahead = rank - 1 if tenant is not None and flow not in self._queued else rank
        mine = any(self.depth[PRIORITIES[r]] for r in range(ahead + 1))  # as the queue's
        if (
            not mine
            and not self._others_waiting(ahead)
            and not (tenant is not None and ahead < rank and self._turn_elsewhere(rank, tenant))
        ):
            got = self._pick_take(model, priority, exclude, weight, hint, tenant, share)
            if isinstance(got, tuple):
                return *got, 0.0
        self._dead(model, priority)
        if priority == "sheddable":
            if self._asleep(model, priority):
                # Not "at capacity" (which invites a retry): nothing will serve it until a
                # request that may wake the pool comes. `x-should-retry: false` stops the
                # openai client's automatic retries, each of which a tenant's limit counts.
                raise ApiError(
                    503,
                    f"model {model} is scaled to zero and sheddable requests do not wake it; "
                    "a standard or critical request does",
                    code="model_asleep",
                    headers={"x-should-retry": "false"},
                )
            raise ApiError(
                429,
                "the service is at capacity; sheddable requests are refused until there is room",
                code="shed",
                headers={"Retry-After": str(self.retry_after)},
            )
        if (self.max_queue is not None and len(self._heap) >= self.max_queue) or (
            self.max_queue_bytes is not None
            and self.queued_bytes + size > self.max_queue_bytes
            and self._heap
        ):
            raise ApiError(
                429,
                f"the service is at capacity and its queue is full ({len(self._heap)} "
                f"request(s), {self.queued_bytes} bytes waiting)",
                code="queue_full",
                headers={"Retry-After": str(self.retry_after)},
            )
        loop = asyncio.get_running_loop()
        want = self._wants(model, priority)
        self.depth[priority] += 1
        tagged: tuple[int, float] | None = None
        low: int | None = None
        if tenant is not None and (self.shared is not None or want is not None):
            with self._lock():
                fair = self.fair()
                if self.shared is not None:
                    # Its tag on the workers' shared clock (`_fairshare`): its depth
                    # published first, so that the table never counts a waiter of a row that
                    # shows none.
                    self._publish()
                    tagged = fair.enqueue(rank, tenant, share)
                if want is not None:
                    if tagged is not None:
                        low = fair.low_group(rank, want)
                    # Asking for a slot there makes it active (the reserve).
                    i = fair.flow(rank, tenant, want, share)
                    if i is not None:
                        fair.mark(i, time.monotonic())
        if tagged is None:
            start = max(self._vtime[rank], self._next.get(flow, 0.0))
            self._next[flow] = start + 1.0 / max(share, 1e-9)
        else:
            start = tagged[1]
        self._queued[flow] = self._queued.get(flow, 0) + 1
        w = _Waiter(
            rank,
            start,
            next(self._seq),
            model,
            priority,
            exclude,
            loop.create_future(),
            weight,
            size,
            hint=hint,
            want=want,
            tenant=tenant,
            share=share,
            tag_flow=None if tagged is None else tagged[0],
            low_group=low,
        )
        heapq.heappush(self._heap, w)
        self._counted(w, 1)
        if low is not None:
            lows = self._lows.setdefault(low, [])
            heapq.heappush(lows, w)
            if lows[0] is w:
                self.fair().publish_low(low, start)
        if want is not None:
            self.waiting[want] = self.waiting.get(want, 0) + 1
        self.queued_bytes += size
        self._publish()
        if self.shared is not None and (self._poller is None or self._poller.done()):
            self._poller = asyncio.create_task(self._poll())
        t0 = time.monotonic()
        granted = False
        try:
            self.wake()
            ep, n = await self._wait(w, t0 + self.queue_timeout)
            granted = True
            return ep, n, time.monotonic() - t0
        except TimeoutError:
            if (why := self._unserved(model, priority, starting=False)) is not None:
                raise _no_endpoint(model, why, self.retry_after) from None
            if self._asleep(model, priority):
                # Not "at capacity": no replica of the model's pool runs (at zero replicas,
                # which this request's demand wakes where an autoscaler runs, or all of them
                # starting), and none was ready in time.
                raise ApiError(
                    503,
                    f"model {model} has no replica running yet (its pool is at zero replicas, "
                    "or starting) and none was ready within the queue timeout "
                    f"({self.queue_timeout:g} s): retry shortly (models that start slower than "
                    "that want a longer gateway.queue_timeout_s)",
                    code="model_waking",
                    headers={"Retry-After": str(self.retry_after)},
                ) from None
            raise ApiError(
                429,
                f"no capacity within the queue timeout ({self.queue_timeout:g} s)",
                code="queue_timeout",
                headers={"Retry-After": str(self.retry_after)},
            ) from None
        finally:
            if not w.future.done():
                w.future.cancel()
            elif not granted and not w.future.cancelled():
                self.release(*w.future.result())  # a slot arrived as we were cancelled
            self._forget(w)

    async def _wait(self, w: _Waiter, deadline: float) -> tuple[Endpoint, int]:
        """A waiter's slots by `deadline` (TimeoutError past it); while nothing can serve its
        model (`_dead`'s grace is running) it is checked again when the grace ends, so that
        it too gets the 503 then rather than at the queue timeout."""
        key = (w.model, w.priority)
        while True:
            now = time.monotonic()
            step = deadline - now
            if (dead := self._dead_at.get(key)) is not None:
                step = min(step, max(0.05, dead[0] + DEAD_GRACE_S - now))
            try:
                return await asyncio.wait_for(asyncio.shield(w.future), max(0.0, step))
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise
                self._dead(w.model, w.priority)

    def _forget(self, w: _Waiter) -> None:
        if not remove(self._heap, w):
            return
        self._counted(w, -1)
        self.depth[w.priority] -= 1
        self.queued_bytes -= w.size
        if w.want is not None:
            self.waiting[w.want] -= 1
        flow = (w.rank, w.tenant)
        left = self._queued[flow] = self._queued[flow] - 1
        if left <= 0:  # idle again: its next waiter starts at the class's time
            del self._queued[flow]
            self._next.pop(flow, None)
        fair = self._fair
        if w.tag_flow is not None and fair is not None:
            fair.dequeue(w.tag_flow)  # before the depth that shows it
        if w.low_group is not None and fair is not None:
            w.left = True
            lows = self._lows[w.low_group]
            if lows[0] is w:
                while lows and lows[0].left:
                    heapq.heappop(lows)
                fair.publish_low(w.low_group, lows[0].vt if lows else None)
                if not lows:
                    del self._lows[w.low_group]
        self._publish()

    def release(self, ep: Endpoint, n: int = 1) -> None:
        if isinstance(n, _Slots) and self._fair is not None:
            # Before the slot: a worker's tenant counts never exceed its slots (`_fairshare`).
            self._fair.leave(n.flow, n, time.monotonic())
        ep.slot.add(-n)
        self.held[ep.pool] = self.held.get(ep.pool, 0) - n
        if self._heap:
            self.wake()

    def _counted(self, w: _Waiter, d: int) -> None:
        if w.exclude:
            self._excluding += d
            return
        kind = (w.model, w.priority, w.weight, w.tenant)
        left = self._kinds[kind] = self._kinds.get(kind, 0) + d
        if left <= 0:
            del self._kinds[kind]

    def _all_blocked(self, full: set[tuple[str, str, int]], held: set[_Kind]) -> bool:
        """Has this pass found every kind of waiter queued without room (or only another
        tenant's reserve)? Then none behind can be served either."""
        if self._excluding:
            return False
        return all(k[:3] in full or k in held for k in self._kinds)

    def _lapse_later(self) -> None:
        """One process: wake the waiters again when the reserve that held one back may have
        lapsed (nothing else may free a slot by then). Workers poll anyway."""
        if self.shared is None and (self._lapse is None or self._lapse.cancelled()):
            loop = asyncio.get_running_loop()
            self._lapse = loop.call_later(RESERVE_WINDOW_S, self._lapsed)

    def _lapsed(self) -> None:
        self._lapse = None
        self.wake()

    async def _poll(self) -> None:
        """Slots freed by other workers reach this one's waiters."""
        while self._heap:
            await asyncio.sleep(POLL_S)
            self.wake()

    def wake(self) -> None:
        """Hand free slots to waiters, best priority first."""
        if not self._heap:
            return
        served: list[_Waiter] = []
        full: set[tuple[str, str, int]] = set()  # requests like these found no room just now
        held: set[_Kind] = set()  # ... room only in a reserve
        now = time.monotonic()
        # Whether another worker queues at each priority, and better: the same for every
        # waiter of a rank here.
        sh = self.shared
        others = [sh is not None and sh.queued(r) > self.depth[p] for r, p in enumerate(PRIORITIES)]
        elsewhere = [any(others[:r]) for r in range(len(PRIORITIES))]
        lowest: dict[int, float] = {}  # per low group: the lowest tag another worker has
        for w in in_order(self._heap):
            if w.future.done():
                served.append(w)
                continue
            defer = elsewhere[w.rank]
            if not defer and w.low_group is not None and others[w.rank]:
                # Fair queueing across workers: a lower start tag waiting in another worker
                # for the same pool goes first, as a better priority does.
                lo = lowest.get(w.low_group)
                if lo is None:
                    assert self._fair is not None
                    lo = lowest[w.low_group] = self._fair.lowest_elsewhere(w.rank, w.low_group)
                defer = lo < w.vt - TAG_EPS * max(1.0, w.vt)
            key = (w.model, w.priority, w.weight)
            if not w.exclude and (key in full or (*key, w.tenant) in held):
                w.deferred = None
                continue
            if defer:
                # Defer only while there is room: the clock runs from when a slot is free (a
                # waiter a pass did not reach since one found none restarts it).
                if not self.pool.has_room(w.model, w.priority, w.exclude, w.weight):
                    w.deferred = None
                    if not w.exclude:  # nor for the ones like it behind
                        full.add(key)
                        self._full_at[key] = now
                        if self._all_blocked(full, held):
                            break
                    continue
                if w.deferred is None or (
                    not w.exclude and w.deferred <= self._full_at.get(key, 0.0)
                ):
                    w.deferred = now
                if now - w.deferred < DEFER_S:
                    continue
            vt = None if w.tag_flow is None else w.vt
            got = self._pick_take(
                w.model, w.priority, w.exclude, w.weight, w.hint, w.tenant, w.share, vt
            )
            if got is None:
                if not w.exclude:
                    full.add(key)
                    self._full_at[key] = now
                    if self._all_blocked(full, held):
                        break
                continue
            if isinstance(got, _HeldBack):
                self._lapse_later()
                if not w.exclude:
                    held.add((*key, w.tenant))
                    if self._all_blocked(full, held):
                        break
                continue
            w.future.set_result(got)
            self._vtime[w.rank] = max(self._vtime[w.rank], w.vt)
            served.append(w)
        for w in served:
            self._forget(w)


def _no_endpoint(model: str, why: str, retry_after: int) -> ApiError:
    return ApiError(
        503,
        f"no endpoint can serve model {model} now: {why}",
        code="no_endpoint",
        headers={"Retry-After": str(retry_after)},
    )
