"""What a routing policy is given and what it answers: the request as a policy sees it
(`PickRequest`), an endpoint as a policy sees it (`Candidate`), and the interface every
policy has (`RoutingPolicy`).

The lowest routing module: the policies (`_latency`, `_adapters`, `_affinity`, `_routing`)
and the pool that runs them (`_pool`) import it, and it imports none of them. So a policy
names the types it works on without importing the pool, which imports the policies (the
default one and the adapter wrapper): no cycle, not even through annotations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    from unbroken.gateway._prefix import RouteHint

__all__ = ["Candidate", "PickRequest", "RoutingPolicy"]


@dataclass(frozen=True, slots=True)
class PickRequest:
    """What a routing policy may look at besides the candidates: the request's prompt as
    block names and its session key (`hint`, None where the gateway computed none), and
    whether it is a new request or a retry or continuation (`fresh`)."""

    model: str
    priority: str
    hint: RouteHint | None = None
    fresh: bool = True


class Candidate(Protocol):
    """An endpoint as every policy may read it (`_pool.Endpoint` is the one kind); a policy
    that reads more says so in a protocol of its own that extends this one."""

    name: str
    pool: str
    models: set[str]  # served names and adapters
    adapters: dict[str, str]  # LoRA adapter -> its base model

    @property
    def inflight(self) -> int: ...  # this gateway's streams and requests on it

    @property
    def load(self) -> float: ...  # in flight + engine queue or others' legs + weighted KV use


E = TypeVar("E", bound=Candidate)


class RoutingPolicy(Protocol[E]):
    """`pick` one of `candidates` (ready, healthy, serving the model, room under the cap),
    or None. What the pool also calls when a policy has it: `on_admit(ep, request)` once per
    admitted leg, `forget(name)` for a removed endpoint, and `pick_route(pools, request,
    fresh=...)` to choose among every pool of the route that has candidates."""

    def pick(self, candidates: list[E], request: PickRequest) -> E | None: ...
