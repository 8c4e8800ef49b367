"""The autoscaler's decisions: how many replicas each autoscaled pool wants, from the
gateway's demand signal (`unbroken_gateway_pool_demand`: sequences running on the pool plus
requests queued for it). Pure logic; `controller/scaling.py` reads the signal and asks the
supervisor to resize.

The rule is the HPA's, with its guards:
- desired = ceil(demand / target), clamped to [min, max] and never below the controller's
  floor of full-precision replicas for critical work (held by one pool per model:
  `scaling.floor_carriers`); a ratio within `tolerance` of 1 keeps the current count (no
  flapping at the target); a resize to the least the pool must hold says so, not "demand";
- up at once and in proportion (a burst that needs three replicas gets three), at most every
  `up_cooldown_s`; a pool at 0 with any demand wakes to at least one;
- down only after demand has wanted fewer replicas for `down_quiet_s` without a break, one
  replica at a time, at most every `down_cooldown_s`;
- demand a pool at `max` cannot hold spills to the next pool of the same model (a sleeping
  fallback tier wakes when the primary is full), as the gateway's routes spill requests:
  what the pool holds at `max` is max x its cap (the gateway sends a replica at most `cap`
  streams and moves a request to a later pool only when every replica of the first is at
  its cap), so the fallback wakes only for demand the gateway will really send it. Its
  SLO spill ("SLO-aware spill to the fallback tier", docs/gateway.md) only moves work to a
  pool that already has replicas; it never wakes one. Without a cap (`PoolScaling.cap`
  None) the room is max x target, as before;
- contention is not load: while a replica of the pool is contended (the controller caps and
  routes around it), scaling holds, so the pool is not grown on the same node because its
  cap was lowered, nor shrunk while it recovers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["Autoscaler", "PoolScaling", "ScaleDecision"]


@dataclass(frozen=True)
class PoolScaling:
    name: str
    min: int
    max: int
    target: float
    tolerance: float = 0.1
    up_cooldown_s: float = 2.0
    down_quiet_s: float = 30.0
    down_cooldown_s: float = 10.0
    floor: int = 0  # the controller's min_full_replicas, on its model's carrier pool
    spill_to: str | None = None  # the next pool of the same model in route order
    # The gateway's in-flight cap per replica (the pool's `cap`, else `gateway.default_cap`):
    # the pool at `max` holds max x cap before the gateway moves work to `spill_to`.
    cap: int | None = None

    @property
    def room(self) -> float:
        """The demand the pool holds at `max` before any spills to the next pool."""
        return self.room_at(self.max)

    def room_at(self, replicas: int) -> float:
        """What `replicas` of the pool hold before the gateway moves work on."""
        return replicas * (self.cap if self.cap is not None else self.target)


@dataclass(frozen=True)
class ScaleDecision:
    pool: str
    current: int
    desired: int
    demand: float
    reason: str

    @property
    def direction(self) -> str:
        return "up" if self.desired > self.current else "down"


@dataclass
class _PoolState:
    desired: int = 0
    last_up: float = -math.inf
    last_down: float = -math.inf
    below_since: float | None = None
    held: str | None = None  # why scaling holds, said once per episode


@dataclass
class Autoscaler:
    pools: list[PoolScaling]
    state: dict[str, _PoolState] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for p in self.pools:
            self.state.setdefault(p.name, _PoolState(desired=p.min))

    def desired(self, name: str) -> int:
        return self.state[name].desired

    def wanted(
        self, demand: dict[str, float], limited: dict[str, int] | None = None
    ) -> dict[str, tuple[int, float]]:
        """Per pool, (replicas its demand wants before guards, the demand counted), with
        what a pool at `max` cannot hold (`PoolScaling.room`) spilled down its chain.
        `limited`: pools that cannot grow now (the supervisor refused a resize for want of
        memory, or CPU), by the replicas they run: they hold only what those hold, and the
        rest spills, so a fallback wakes for a primary that cannot reach `max`."""
        demand = dict(demand)
        limited = limited or {}
        out: dict[str, tuple[int, float]] = {}
        for p in self.pools:  # spec order: a primary before its fallback
            d = max(0.0, demand.get(p.name, 0.0))
            raw = math.ceil(d / p.target - 1e-9) if d > 0 else 0
            room = p.room_at(min(p.max, limited[p.name])) if p.name in limited else p.room
            if p.spill_to is not None and d > room:
                demand[p.spill_to] = demand.get(p.spill_to, 0.0) + d - room
            out[p.name] = (raw, d)
        return out

    def step(
        self,
        now: float,
        demand: dict[str, float],
        current: dict[str, int],
        contended: dict[str, int] | None = None,
        busy: set[str] | frozenset[str] = frozenset(),
        limited: dict[str, int] | None = None,
    ) -> list[ScaleDecision]:
        """The resizes to ask for now. `current`: live replicas per pool; `busy`: pools with
        a resize (or rollout) under way, left alone until it ends; `limited`: as `wanted`."""
        contended = contended or {}
        wanted = self.wanted(demand, limited)
        out: list[ScaleDecision] = []
        for p in self.pools:
            st = self.state[p.name]
            cur = current.get(p.name, 0)
            raw, d = wanted[p.name]
            lo = max(p.min, min(p.floor, p.max))
            want = max(lo, min(p.max, raw))
            if cur > 0 and d > 0 and want != cur and abs(d / (cur * p.target) - 1) <= p.tolerance:
                want = cur  # within tolerance of the target: keep
            if d > 0 and cur == 0:
                want = max(want, 1)
            if p.name in busy:
                st.below_since = None
                continue
            if contended.get(p.name, 0) > 0 and want != cur:
                if st.held is None:
                    st.held = "contended"
                st.below_since = None
                continue
            st.held = None
            if want > cur:
                st.below_since = None
                if now - st.last_up < p.up_cooldown_s:
                    continue
                st.last_up = now
                st.desired = want
                if raw < want and want == lo:  # the pool's least, not its demand
                    why = f"below its least of {lo} replica(s) (min {p.min}"
                    why += f", full-precision floor {p.floor})" if p.floor > p.min else ")"
                    why += f"; demand {d:g}"
                    if cur == 0:
                        why = f"starting: {why}"
                elif cur == 0:
                    why = f"waking: demand {d:g} at 0 replicas"
                else:
                    why = f"demand {d:g} over {cur} replica(s) at target {p.target:g}"
                out.append(ScaleDecision(p.name, cur, want, d, why))
            elif want < cur:
                if st.below_since is None:
                    st.below_since = now
                if now - st.below_since < p.down_quiet_s or now - st.last_down < p.down_cooldown_s:
                    continue
                st.last_down = now
                st.desired = cur - 1
                quiet = now - st.below_since
                why = f"demand {d:g} wants {want} for {quiet:.1f} s (quiet {p.down_quiet_s:g} s)"
                out.append(ScaleDecision(p.name, cur, cur - 1, d, why))
            else:
                st.below_since = None
                st.desired = cur
        return out
