"""The seam between the logic that changes a pool and what runs the replicas.

Rollouts, conversions and scaling (`run_rollout`, `run_convert`, `run_scale`) only talk to a
`Backend`: the local supervisor implements it today (`supervisor.Supervisor`, processes on
this machine, its replicas kept by `replicas.ReplicaSet`); a Kubernetes implementation can
implement it later (pods of a Deployment) without touching their steps.
"""

from __future__ import annotations

from typing import Any, Protocol

from unbroken.clients import GatewayAdmin
from unbroken.config.spec import PipelineSpec, PoolSpec

__all__ = ["Backend", "ReplicaHandle"]


class ReplicaHandle(Protocol):
    """One running replica of an engine pool."""

    @property
    def name(self) -> str: ...

    @property
    def url(self) -> str: ...

    @property
    def pid(self) -> int | None: ...

    @property
    def alive(self) -> bool: ...

    @property
    def serving(self) -> bool:
        """Alive and answering /health (not still starting)."""
        ...


class Backend(Protocol):
    spec: PipelineSpec
    admin: GatewayAdmin

    def replicas_of(self, pool: str) -> list[ReplicaHandle]:
        """The pool's live replicas that are not being stopped, oldest first."""
        ...

    async def prewarm(self, pool: PoolSpec) -> dict[str, Any] | None: ...

    async def start_replica(self, pool: PoolSpec) -> ReplicaHandle:
        """Start one more replica of `pool` (not yet registered with the gateway)."""
        ...

    async def wait_health(self, r: ReplicaHandle, *, timeout: float | None = None) -> None:
        """Stage 1: until `/health` answers; raises if the replica dies first, TimeoutError
        after `timeout` (None: its pool's `engine.health_timeout_s`)."""
        ...

    def adopt(self, r: ReplicaHandle) -> None:
        """The replica is in service: replace it if it dies from now on."""
        ...

    async def stop_replica(self, r: ReplicaHandle, *, timeout: float = 30.0) -> int | None:
        """Stop it (gracefully, then by force after `timeout`); its exit code."""
        ...

    def set_pool(self, pool: PoolSpec) -> None:
        """From now on, replicas of this pool (replacements included) run this spec."""
        ...

    def record(self, kind: str, **data: Any) -> None: ...
