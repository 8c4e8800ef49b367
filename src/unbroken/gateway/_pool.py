"""Endpoints and their states, and the load-aware pick.

States: starting → warming → ready → draining → gone. Only ready, healthy endpoints with room
under their cap receive new requests.

The controller adjusts two things here without touching what the operator configured: a cap
override per endpoint (the effective cap is the lower of the two) and a routes override per
priority. Clearing an override restores the configured value exactly, so undoing an action
never needs the controller to remember the original.

Picking walks the priority's pool preference list; within the first pool that has candidates
(ready, healthy, serving the model, room under the cap) a routing policy chooses one. The
policy is one object with `pick(candidates, request)`; a new policy (prefix or session
affinity) is one class plus its test. A policy that also has `pick_route(pools, request,
fresh=...)` is given every pool of the route that has candidates and may choose a later one.
Whatever the policy, the pool wraps it in `AdapterAffinity` (`_adapters.py`): a request for
a LoRA adapter is narrowed to the candidates that have it loaded (within load bounds) before
the policy chooses; other requests reach the policy untouched.
The default is `LatencyAware` (`_latency.py`): least load weighted by each endpoint's
expected time to first token, as measured on the gateway's own streams (each endpoint's
`latency`, fed by the relay through `observe_first` and `observe_gap`, and by its `relays`
set as legs start and end); `LeastLoad` is the plain load score.

An endpoint's in-flight count lives in its `slot`: a plain counter in a single-process
gateway, a column of the shared table (`_shared.py`) when several workers serve, so that the
cap holds for all of them together.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import itertools
import struct
import termios
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from unbroken.gateway._adapters import AdapterAffinity, LoraInfo
from unbroken.gateway._latency import EndpointLatency, LatencyAware
from unbroken.gateway._policy import PickRequest, RoutingPolicy
from unbroken.gateway._prefix import CHARS_PER_TOKEN, RouteHint

__all__ = [
    "CONDITIONS",
    "KV_WEIGHT",
    "SLOW_CLIENT_BYTES",
    "Endpoint",
    "LatencyAware",
    "LeastLoad",
    "LocalSlot",
    "PickRequest",
    "Pool",
    "RoutingPolicy",
    "Slot",
    "State",
]

# What the controller last concluded about an endpoint (it sets it; the gateway shows it).
CONDITIONS = ("normal", "contended", "recovering")
# A stream whose client has this much unread output waiting in the gateway counts as a slow
# client of its endpoint (reported, never acted on: the gateway already isolates it).
SLOW_CLIENT_BYTES = 64 * 1024

# One full KV cache weighs like 4 queued requests in the load score.
KV_WEIGHT = 4.0


class State(enum.StrEnum):
    STARTING = "starting"
    WARMING = "warming"
    READY = "ready"
    DRAINING = "draining"
    GONE = "gone"


class Slot(Protocol):
    def get(self) -> int: ...
    def add(self, n: int) -> None: ...
    def serve(self) -> None: ...
    def served(self) -> int: ...


class LocalSlot:
    """In-flight count (and legs admitted, ever) of a single-process gateway."""

    __slots__ = ("n", "s")

    def __init__(self) -> None:
        self.n = 0
        self.s = 0

    def get(self) -> int:
        return self.n

    def add(self, n: int) -> None:
        self.n += n

    def serve(self) -> None:
        self.s += 1

    def served(self) -> int:
        return self.s


class _Legs(set[Any]):
    """An endpoint's streams being relayed (`Endpoint.relays`); a leg joins when it starts
    and leaves when it ends, which tells the endpoint's latency which legs still wait for
    their first event, and what prefill each may bring to the step that takes it: its whole
    prompt (`RouteHint.chars`), not the part the prefix index did not credit the endpoint
    with: the index is approximate, and an engine that evicted a credited prefix prefills
    it all."""

    __slots__ = ("latency",)

    def __init__(self, latency: EndpointLatency) -> None:
        super().__init__()
        self.latency = latency

    def add(self, leg: Any) -> None:
        super().add(leg)
        hint: RouteHint | None = getattr(leg, "hint", None)
        if hint is None:
            self.latency.leg_started(leg)
        else:
            self.latency.leg_started(
                leg, prefill_tokens=hint.chars / CHARS_PER_TOKEN, own_prefill_s=hint.own_s
            )

    def discard(self, leg: Any) -> None:
        super().discard(leg)
        self.latency.leg_ended(leg)


@dataclass(eq=False)
class Endpoint:
    name: str
    url: str
    pool: str = "default"
    cap: int | None = None
    cap_override: int | None = None  # set by the controller; effective cap = min(cap, this)
    condition: str = "normal"
    condition_since: float = field(default_factory=time.time)
    state: State = State.STARTING
    warmup: bool = True
    slot: Slot = field(default_factory=LocalSlot, repr=False)
    models: set[str] = field(default_factory=set)  # served names and adapters (/v1/models)
    adapters: dict[str, str] = field(default_factory=dict)  # LoRA adapter -> its base model
    lora: LoraInfo | None = None  # scraped vllm:lora_requests_info (None: LoRA off/unknown)
    waiting: float = 0.0  # scraped vllm:num_requests_waiting
    running: float = 0.0  # scraped vllm:num_requests_running
    # What the engine held beyond this gateway's own legs at the last scrape (running +
    # waiting - in flight here, at least 0): other gateway replicas' streams, or clients
    # that go to the engine directly. Each replica counts only its own legs in `inflight`;
    # this puts the rest into its load score (`load`), so replicas see the same engines.
    foreign: float = 0.0
    kv_usage: float = 0.0  # scraped vllm:kv_cache_usage_perc (0..1)
    # Scraped vllm:generation_tokens_total (-1: not read yet), and when (time.monotonic) a
    # scrape last found it risen: the engine made progress, whatever the gateway sees.
    generated: float = -1.0
    progress_at: float = 0.0
    healthy: bool = True
    failures: int = 0
    # Out of rotation because its /health probes fail (unreachable, refusing): the prober's
    # verdict, which a hang suspicion (held out, and tried again) is not.
    down: bool = False
    # The latest failure seen of it (kept after it recovers: a record), and when (time.time).
    last_error: str | None = None
    last_error_at: float | None = None
    drain_deadline: float | None = None  # monotonic
    # Seconds its last warm-up (or hang check) completion took: the first sample of how long
    # a non-streaming answer takes here (`_health.EndpointHealth.answer_limit`), before real
    # ones are known.
    warmup_s: float | None = None
    # The engine's `system_fingerprint` (its warm-up answer's, `_prober`): the relay puts it on
    # a stream's finishing chunk for a client who did not ask for usage, where vLLM puts it
    # (the gateway asks for usage, and vLLM then moves it to the usage chunk it strips).
    fingerprint: str | None = None
    state_since: float = field(default_factory=time.time)
    relays: set[Any] = field(default_factory=set)  # streams being relayed from here
    latency: EndpointLatency = field(default_factory=EndpointLatency, repr=False)
    _rr: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.relays, _Legs):
            legs = _Legs(self.latency)
            legs.update(self.relays)
            self.relays = legs

    def observe_first(self, leg: object, seconds: float) -> None:
        """A leg's first event came `seconds` after its response headers (the relay)."""
        self.latency.first_event(leg, seconds)

    def observe_gap(self, seconds: float) -> None:
        """A stream of this endpoint got an event `seconds` after its previous one."""
        self.latency.gap(seconds)

    @property
    def inflight(self) -> int:
        return self.slot.get()

    @property
    def load(self) -> float:
        """This gateway's legs, plus what the engine holds beyond them (`foreign`) or its
        queue, whichever is larger (the queue alone counted before `foreign`: a queue of
        another replica's requests is in both), plus its KV cache's fill."""
        extra = self.waiting if self.waiting > self.foreign else self.foreign
        return self.inflight + extra + KV_WEIGHT * self.kv_usage

    def scraped(self, waiting: float, running: float, kv_usage: float) -> None:
        """A /metrics reading: the engine's queue, its running requests, its KV cache's
        fill; `foreign` from them against this gateway's in-flight count now."""
        self.waiting, self.running, self.kv_usage = waiting, running, kv_usage
        self.foreign = max(0.0, running + waiting - self.inflight)

    def effective_cap(self, default_cap: int) -> int:
        cap = default_cap if self.cap is None else self.cap
        return cap if self.cap_override is None else min(cap, self.cap_override)

    def has_room(self, default_cap: int, weight: int = 1) -> bool:
        """Room for `weight` sequences, at most its whole cap (a request heavier than a cap
        needs the endpoint to itself)."""
        cap = self.effective_cap(default_cap)
        return self.inflight + max(1, min(weight, cap)) <= cap

    def set_condition(self, condition: str) -> None:
        if condition != self.condition:
            self.condition = condition
            self.condition_since = time.time()

    @property
    def slow_clients(self) -> int:
        n = 0
        for r in list(self.relays):
            sink = getattr(r, "sink", None)
            if sink is None:
                continue
            if _backlog(sink) >= SLOW_CLIENT_BYTES:
                n += 1
        return n

    def note_error(self, text: str) -> None:
        """A failure seen of it: its record, stamped."""
        self.last_error, self.last_error_at = text, time.time()

    def set_state(self, state: State) -> None:
        if state != self.state:
            self.state = state
            self.state_since = time.time()

    def as_dict(self, default_cap: int) -> dict[str, Any]:
        return {
            "name": self.name,
            "url": self.url,
            "pool": self.pool,
            "state": str(self.state),
            "healthy": self.healthy,
            "inflight": self.inflight,
            "cap": self.effective_cap(default_cap),
            "configured_cap": self.cap if self.cap is not None else default_cap,
            "cap_override": self.cap_override,
            "condition": self.condition,
            "condition_since": self.condition_since,
            "slow_clients": self.slow_clients,
            "models": sorted(self.models),
            "adapters": dict(sorted(self.adapters.items())),
            "lora": None if self.lora is None else self.lora.as_dict(),
            "waiting": self.waiting,
            "running": self.running,
            "foreign": self.foreign,
            "kv_usage": self.kv_usage,
            # vllm:generation_tokens_total at the last scrape (None: not read yet); a fall
            # is an engine restarted in place (the prober's `restarted`).
            "generated_tokens": None if self.generated < 0 else self.generated,
            "load": round(self.load, 3),
            # Legs admitted here, ever: in every worker (the shared table's count).
            "served": self.slot.served(),
            "routing": self.latency.as_dict(time.monotonic()),
            "last_error": self.last_error,
            "last_error_at": self.last_error_at,
            "state_since": self.state_since,
            "drain_deadline_s": None
            if self.drain_deadline is None
            else round(max(0.0, self.drain_deadline - time.monotonic()), 3),
        }


def _backlog(sink: Any) -> int:
    """Bytes written for a client that it has not read yet: the gateway's queue, the
    transport's buffer, and the kernel's send queue (TIOCOUTQ). The kernel's share matters:
    a socket's send buffer autotunes to megabytes before the gateway queues anything."""
    n = getattr(sink, "buffered", 0)
    t = getattr(sink, "transport", None)
    if t is None or t.is_closing():
        return n
    n += t.get_write_buffer_size()
    sock = t.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError, ValueError):
            n += struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]
    return n


class LeastLoad:
    """The least-loaded candidate (in-flight + engine queue + KV); ties go to the one picked
    longest ago, so equal loads round-robin."""

    def __init__(self) -> None:
        self._tick = itertools.count(1)  # above the initial 0, so a first pick counts

    def pick(self, candidates: list[Endpoint], request: PickRequest) -> Endpoint | None:
        best: Endpoint | None = None
        best_key = (0.0, 0)
        for e in candidates:
            key = (e.load, e._rr)
            if best is None or key < best_key:
                best, best_key = e, key
        if best is not None:
            best._rr = next(self._tick)
        return best


class Pool:
    """All endpoints the gateway knows, by name."""

    def __init__(self, default_cap: int, policy: RoutingPolicy[Endpoint] | None = None) -> None:
        self.default_cap = default_cap
        self.endpoints: dict[str, Endpoint] = {}
        self.pool_order: list[str] = []
        self.routes: dict[str, list[str]] = {}
        self.routes_override: dict[str, list[str]] = {}
        self.policy: RoutingPolicy[Endpoint] = AdapterAffinity(policy or LatencyAware())
        # Names each pool serves per the spec (`GatewaySettings.pool_models`), known before
        # any of its replicas runs: a pool autoscaled to 0 still takes requests for them.
        self.pool_models: dict[str, list[str]] = {}
        self.sleeping: set[str] = set()  # pools autoscaled with min 0 (`sleeping_pools`)

    def add(self, ep: Endpoint) -> None:
        if ep.name in self.endpoints and self.endpoints[ep.name].state != State.GONE:
            raise KeyError(ep.name)
        self.endpoints[ep.name] = ep
        if ep.pool not in self.pool_order:
            self.pool_order.append(ep.pool)

    def remove(self, name: str) -> Endpoint:
        ep = self.endpoints.pop(name)
        ep.set_state(State.GONE)
        self._forget(name)
        return ep

    def restarted(self, ep: Endpoint) -> None:
        """`ep`'s engine is a new process: the policy forgets what it learnt of it (what it
        sent there, which that engine's cache no longer holds) and keeps it a candidate."""
        self._forget(ep.name)

    def _forget(self, name: str) -> None:
        if (forget := getattr(self.policy, "forget", None)) is not None:
            forget(name)

    def admitted(self, ep: Endpoint, model: str, priority: str, hint: RouteHint | None) -> None:
        """A leg was admitted to `ep`: the policy learns it (once per leg; adapter affinity
        learns where adapters went even without a hint)."""
        if (on_admit := getattr(self.policy, "on_admit", None)) is not None:
            on_admit(ep, PickRequest(model, priority, hint))

    def get(self, name: str) -> Endpoint | None:
        return self.endpoints.get(name)

    def pools_for(self, priority: str) -> list[str]:
        return self.routes_override.get(priority) or self.routes.get(priority) or self.pool_order

    def configured_pools_for(self, priority: str) -> list[str]:
        return self.routes.get(priority) or self.pool_order

    def known_models(self) -> set[str]:
        """What live replicas serve, and what the spec says a sleeping pool serves (one
        with no ready replica: autoscaled to 0, or waking). A name the spec gives a pool
        that is up but none of whose ready replicas lists it (a spec adapter unloaded at
        runtime) is not served: OpenAI's 404, as vLLM answers, not a wait for a wake-up
        that never comes."""
        live: set[str] = set().union(*(e.models for e in self.endpoints.values()))
        awake = self._awake()
        return live.union(*(n for p, n in self.pool_models.items() if p not in awake))

    def _awake(self) -> set[str]:
        """The pools with a ready replica whose models were read (what they serve is known)."""
        return {e.pool for e in self.endpoints.values() if e.state == State.READY and e.models}

    def serves(self, model: str) -> bool:
        return any(model in e.models for e in self.endpoints.values() if e.state != State.GONE)

    def configured(self, model: str) -> str | None:
        """The first sleeping pool (no ready replica: `known_models`) the spec says serves
        `model`; None when every pool that declares it is up (then a ready replica lists
        it, or it is not served)."""
        awake = self._awake()
        return next(
            (p for p, names in self.pool_models.items() if model in names and p not in awake),
            None,
        )

    def configure(
        self, pool_models: dict[str, list[str]], sleeping: list[str] | None = None
    ) -> None:
        self.pool_models = {p: list(n) for p, n in pool_models.items()}
        self.sleeping = set(sleeping or ())
        for p in self.pool_models:  # spec order first, as the default route
            if p not in self.pool_order:
                self.pool_order.append(p)

    def _candidates(self, model: str, priority: str, excluded: set[int]) -> list[list[Endpoint]]:
        """The route's pools, in order, each as its candidates for a new leg (ready, healthy,
        serving the model, not excluded, room under the cap); pools without any left out."""
        cap = self.default_cap
        by_pool: list[list[Endpoint]] = []
        for pool in self.pools_for(priority):
            candidates = [
                e
                for e in self.endpoints.values()
                if e.pool == pool
                and e.state == State.READY
                and e.healthy
                and model in e.models
                and id(e) not in excluded
                and e.has_room(cap)
            ]
            # A contended device is the last choice within its pool: its cap already limits
            # it, and a healthy sibling serves the same tier faster.
            healthy = [e for e in candidates if e.condition != "contended"]
            if healthy:
                candidates = healthy
            if candidates:
                by_pool.append(candidates)
        return by_pool

    def has_room(
        self, model: str, priority: str, exclude: Iterable[Endpoint] = (), weight: int = 1
    ) -> bool:
        """Has a candidate room for `weight` sequences (`Endpoint.has_room`)? What waiters
        ask many times a second, answered without the policy: a policy's pick moves its
        turn (`_rr`), and asked first without the lock, then again under it, that made
        round_robin (and every tie of least_load and latency) land each request of a
        multi-worker gateway on one replica."""
        by_pool = self._candidates(model, priority, set(map(id, exclude)))
        return any(e.has_room(self.default_cap, weight) for c in by_pool for e in c)

    def pick(
        self,
        model: str,
        priority: str,
        exclude: Iterable[Endpoint] = (),
        hint: RouteHint | None = None,
    ) -> Endpoint | None:
        exclude = tuple(exclude)
        request = PickRequest(model, priority, hint, not exclude)
        by_pool = self._candidates(model, priority, set(map(id, exclude)))
        route = getattr(self.policy, "pick_route", None)
        if route is not None:
            return route(by_pool, request, fresh=not exclude) if by_pool else None  # type: ignore[no-any-return]
        for candidates in by_pool:
            if (ep := self.policy.pick(candidates, request)) is not None:
                return ep
        return None

    def late(self, ep: Endpoint) -> bool:
        """Is `ep`'s step in progress late, by the policy's measure (`_latency`)? False for
        a policy that measures no latency."""
        late = getattr(self.policy, "late", None)
        return late is not None and bool(late(ep))

    def late_in(self, ep: Endpoint) -> float | None:
        """Seconds until `ep`'s step in progress would count as late, by the policy's
        measure; None where it cannot tell (or measures no latency)."""
        late_in = getattr(self.policy, "late_in", None)
        return None if late_in is None else late_in(ep)  # type: ignore[no-any-return]

    def reroute(
        self,
        ep: Endpoint,
        model: str,
        priority: str,
        exclude: Iterable[Endpoint],
        hint: RouteHint | None = None,
    ) -> bool:
        """Should a leg on `ep` still waiting for its first event be re-sent elsewhere (the
        policy's `reroute`, where it has one: `_latency.LatencyAware`)? Only within `ep`'s
        own pool: a late step is transient, and moving work to another tier for it (fp16 to
        fp8) would change what the client gets; a pool of one has nowhere to go. Never to a
        contended replica either: it is slow for the whole episode, while `ep`'s late step is
        transient (the controller's test saw critical streams moved onto the contended
        device this way, on CI's busy cores)."""
        decide = getattr(self.policy, "reroute", None)
        if decide is None:
            return False
        by_pool = self._candidates(model, priority, {id(ep), *map(id, exclude)})
        same = [
            e
            for cands in by_pool
            for e in cands
            if e.pool == ep.pool and e.condition != "contended"
        ]
        if not same:
            return False
        return bool(decide(ep, same, PickRequest(model, priority, hint, False)))

    def could_serve(self, model: str, priority: str, exclude: Iterable[Endpoint] = ()) -> bool:
        """Is there a ready, healthy endpoint for this request, full or not?"""
        excluded = set(map(id, exclude))
        pools = set(self.pools_for(priority))
        return any(
            e.pool in pools
            and e.state == State.READY
            and e.healthy
            and model in e.models
            and id(e) not in excluded
            for e in self.endpoints.values()
        )
