"""What a stream relay needs of the gateway (`RelayHost`): the seam through which it opens
upstream legs, the endpoints' records it reads and writes, and its client sinks. Apart from
the relay so that each side can be read alone: `_proxy.Proxy` implements it, the relay
(`_stream`) and a stream adopted from another process (`_stream_handover`) only call it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from aiohttp import web

from unbroken.gateway._pool import Endpoint
from unbroken.gateway._prefix import RouteHint
from unbroken.gateway._relay import ClientSink
from unbroken.gateway._upstream import Form, Leg

if TYPE_CHECKING:
    from unbroken.config.spec import GatewaySettings as GatewayConfig
    from unbroken.gateway._metrics import GatewayMetrics

__all__ = ["RelayHost"]


class RelayHost(Protocol):
    """What a relay needs of the gateway (the proxy is one): the seam to open upstream legs,
    the endpoints' records, and its client sinks."""

    cfg: GatewayConfig
    metrics: GatewayMetrics

    async def open_upstream(
        self,
        model: str,
        priority: str,
        forms: Sequence[Form],
        exclude: list[Endpoint],
        *,
        limit: Callable[[Endpoint], float],
        streaming: bool = True,
        weight: int = 1,
        size: int = 0,
        headers: dict[str, str],
        hint: RouteHint | None = None,
    ) -> Leg: ...
    def could_serve(self, model: str, priority: str, exclude: list[Endpoint]) -> bool: ...
    def release(self, ep: Endpoint, n: int = 1) -> None: ...
    def upstream_failed(self, ep: Endpoint, kind: str, detail: str) -> None: ...
    def ttfb_limit(self, ep: Endpoint) -> float: ...
    def observe_ttfb(self, ep: Endpoint, seconds: float) -> None: ...
    def watch_streams(self) -> None: ...
    def alive(self, ep: Endpoint) -> bool: ...
    def first_byte_patience(
        self, ep: Endpoint, start: float
    ) -> Callable[[float], float | None]: ...
    def response_headers(self, base: dict[str, str], ep: Endpoint | None) -> dict[str, str]: ...
    async def detokenize(
        self, model: str, ids: list[int], exclude: list[Endpoint], headers: dict[str, str]
    ) -> str | None: ...
    def stream_sink(self, request: web.Request, resp: web.StreamResponse) -> ClientSink: ...
    def drop_sink(self, sink: ClientSink) -> None: ...
