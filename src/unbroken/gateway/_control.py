"""What the control plane may do to a gateway: `GatewayControl`, the one interface the admin
API (`_admin.py`) and Kubernetes discovery (`_discovery.py`) are given.

`_server.Gateway` implements it (the main process of several workers, `_main.MainGateway`,
through it, overriding what must reach the workers). An interface of its own, so that the
admin API and discovery depend on what they call rather than on `_server`, which builds
them: the package stays a one-way stack, readable bottom-up.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from unbroken.config.spec import GatewaySettings
    from unbroken.gateway._admission import Admission
    from unbroken.gateway._metrics import GatewayMetrics
    from unbroken.gateway._pool import Endpoint, Pool

__all__ = ["GatewayControl"]


class GatewayControl(Protocol):
    """The endpoints' lifecycle, caps and routes, and what `/admin/status` reports."""

    cfg: GatewaySettings
    pool: Pool
    admission: Admission
    metrics: GatewayMetrics
    started: float  # wall-clock time
    port: int  # the public port, as bound

    def add_endpoint(
        self,
        url: str,
        *,
        name: str,
        pool_name: str = "default",
        cap: int | None = None,
        warmup: bool = True,
    ) -> Endpoint: ...

    def remove_endpoint(self, ep: Endpoint) -> None: ...

    def drain_endpoint(self, ep: Endpoint, deadline_s: float | None) -> None: ...

    def rebalance(
        self,
        ep: Endpoint,
        priorities: Iterable[str],
        batch: int | None = None,
        every_s: float = 0.1,
    ) -> int: ...

    def patch_endpoint(self, ep: Endpoint, fields: dict[str, Any]) -> None: ...

    def set_routes(self, routes: dict[str, list[str]]) -> None: ...

    def set_routes_override(self, routes: dict[str, list[str]]) -> None: ...

    async def sync(self) -> None: ...

    def process_status(self) -> dict[str, Any]: ...
