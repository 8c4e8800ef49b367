"""The routing policies by name (`routing:` in the gateway settings, `--routing`).

A policy has `pick(candidates, request)`, and may have `pick_route(pools, request, fresh=)`
(it is given every pool of the route that has candidates), `on_admit(ep, request)` (called
once per admitted leg: what it learns from where requests went) and `forget(name)` (an
endpoint is gone). A new policy is one class, one line in `POLICIES` and its test.

- `prefix` (default): `CacheAware`, the expected first-token time including the prefill of
  the part of the prompt a candidate does not hold (prefix index, session affinity, bounded
  load);
- `session`: `CacheAware` without the prefix index (session affinity only);
- `latency`: `LatencyAware`, least load weighted by the measured expected first-token time;
- `least_load`: `LeastLoad`, in-flight + engine queue + KV;
- `power_of_two`: `PowerOfTwo`, the less loaded of two candidates drawn at random;
- `round_robin`: `RoundRobin`, each candidate in turn (what a plain L4 balancer does);
- `random`: `Random`, any candidate, uniformly.

The peers' names are read as ours (`config.spec.ROUTING_ALIASES`, applied by the
settings): vllm-router's and SGLang's `cache_aware` is `prefix` and `consistent_hash` is
`session`; production-stack's `--routing-logic` `roundrobin` and `prefixaware` are
`round_robin` and `prefix`.

Whichever is configured, the pool wraps it in `AdapterAffinity` (`_adapters.py`): a request
for a LoRA adapter is first narrowed to the candidates that have it loaded, or else have a
free adapter slot, within a load bound; the configured policy then chooses among them.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from typing import TYPE_CHECKING

from unbroken.gateway._affinity import AffinitySettings, CacheAware
from unbroken.gateway._latency import LatencyAware, LatencySettings
from unbroken.gateway._pool import Endpoint, LeastLoad, PickRequest, RoutingPolicy

if TYPE_CHECKING:
    from unbroken.config.spec import GatewaySettings
    from unbroken.gateway._prefix_table import PrefixTable

__all__ = ["POLICIES", "PowerOfTwo", "Random", "RoundRobin", "make_policy"]


class RoundRobin:
    """Each candidate in turn, whatever its load (what a plain L4 balancer does)."""

    def __init__(self) -> None:
        self._tick = itertools.count(1)

    def pick(self, candidates: list[Endpoint], request: PickRequest) -> Endpoint | None:
        if not candidates:
            return None
        best = min(candidates, key=lambda e: e._rr)
        best._rr = next(self._tick)
        return best


class PowerOfTwo:
    """The less loaded (in-flight + engine queue + KV) of two candidates drawn at random
    (vllm-router's and SGLang's `power_of_two`): near least-load's balance without every
    worker and gateway replica herding to the same least-loaded replica between updates."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def pick(self, candidates: list[Endpoint], request: PickRequest) -> Endpoint | None:
        if len(candidates) < 2:
            return candidates[0] if candidates else None
        a, b = self._rng.sample(candidates, 2)
        return b if b.load < a.load else a


class Random:
    """Any candidate, uniformly (vllm-router's `random`): a baseline, blind to load."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def pick(self, candidates: list[Endpoint], request: PickRequest) -> Endpoint | None:
        return self._rng.choice(candidates) if candidates else None


def _latency(cfg: GatewaySettings) -> LatencySettings:
    return LatencySettings(
        ttft_targets={k: None if v is None else v / 1e3 for k, v in cfg.ttft_target_ms.items()},
        slo_ratio=cfg.slo_spill_ratio,
        slo_min_load=cfg.slo_spill_min_load,
        prefill_s_per_token=cfg.prefill_us_per_token / 1e6,
    )


def _affinity(cfg: GatewaySettings, *, prefix: bool) -> AffinitySettings:
    return AffinitySettings(
        use_prefix=prefix,
        # `prefix`: a session key is a tie-breaking prior, not a home the whole conversation
        # is credited to: hashing's uneven share of conversations filled one replica's KV
        # cache (docs/bench.md, "Multi-turn: where a first token's time goes").
        session_blocks=AffinitySettings.home_blocks if prefix else None,
        prefill_s_per_token=cfg.prefill_us_per_token / 1e6,
        blocks_per_endpoint=cfg.prefix_index_blocks,
        balance_abs=cfg.prefix_balance_abs,
        balance_rel=cfg.prefix_balance_rel,
    )


# (settings, the gateway's shared prefix table or None) -> policy
POLICIES: dict[str, Callable[[GatewaySettings, PrefixTable | None], RoutingPolicy]] = {
    "prefix": lambda c, t: CacheAware(_latency(c), _affinity(c, prefix=True), t),
    "session": lambda c, _t: CacheAware(_latency(c), _affinity(c, prefix=False)),
    "latency": lambda c, _t: LatencyAware(_latency(c)),
    "least_load": lambda _c, _t: LeastLoad(),
    "power_of_two": lambda _c, _t: PowerOfTwo(),
    "round_robin": lambda _c, _t: RoundRobin(),
    "random": lambda _c, _t: Random(),
}


def make_policy(cfg: GatewaySettings, prefix_table: PrefixTable | None = None) -> RoutingPolicy:
    """`prefix_table`: the prefix index every worker of this gateway shares (`_main.py`
    makes it); None: the policy keeps its own (a single-process gateway)."""
    try:
        return POLICIES[cfg.routing](cfg, prefix_table)
    except KeyError:
        raise ValueError(
            f"unknown routing policy {cfg.routing!r}; choose one of {', '.join(POLICIES)}"
        ) from None
