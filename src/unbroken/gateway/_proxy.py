"""The proxy of one gateway process: its parts, built and wired here, and the face a stream's
relay sees of them (`_stream.RelayHost`).

Reading order, bottom-up: `_headers` (what goes up and comes back), `_health` (each
endpoint's records and the verdict on a failure), `_legs` (the one way upstream: admit, send,
record), `_tenancy` (who a request is, its limits), `_stream` (a stream and its legs),
`_forward` (a completion's attempts), `_handlers` (the HTTP routes; `Proxy` is one).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import aiohttp
import orjson
from aiohttp import web

from unbroken.gateway._admission import Admission
from unbroken.gateway._engine_routes import ResponseHomes
from unbroken.gateway._forward import Forwarder
from unbroken.gateway._handlers import PASSTHROUGH_ROUTES, Handlers, _max_tokens, _wants
from unbroken.gateway._headers import Headers
from unbroken.gateway._health import EndpointHealth
from unbroken.gateway._legs import Legs
from unbroken.gateway._pool import Endpoint, Pool, State
from unbroken.gateway._ratelimit import Limiter
from unbroken.gateway._relay import BufferBudget, ClientSink
from unbroken.gateway._tenancy import METER_S, Tenancy
from unbroken.gateway._tenants import Tenants
from unbroken.gateway._upstream import UPSTREAM_ERRORS, Upstream

if TYPE_CHECKING:
    from unbroken.config.spec import GatewaySettings
    from unbroken.gateway._metrics import GatewayMetrics

# `_max_tokens`, `_wants`: the request readers, kept importable from here (tests use them).
__all__ = ["METER_S", "PASSTHROUGH_ROUTES", "Proxy", "_max_tokens", "_wants"]


class Proxy(Handlers):
    """The routes (`Handlers`) over this process's parts; `metrics` may be given later (the
    gateway builds its metrics from the proxy's sinks), and reaches every part."""

    def __init__(
        self,
        cfg: GatewaySettings,
        pool: Pool,
        admission: Admission,
        metrics: GatewayMetrics,
        on_release: Callable[[Endpoint], None],
    ) -> None:
        self.cfg = cfg
        self.pool = pool
        self.admission = admission
        self.session: aiohttp.ClientSession | None = None  # probes, /v1/models, pass-through
        self.sinks: set[ClientSink] = set()  # live streams, for the buffered-bytes gauge
        self.buffer_budget = BufferBudget(cfg.stream_buffer_budget_bytes)
        self.upstream = Upstream(cfg.connect_timeout_s)  # completions' own HTTP client
        self.headers = Headers(cfg)
        self.health = EndpointHealth(cfg, pool, metrics)
        self.tenancy = Tenancy(cfg, self.headers, metrics)
        self.homes = ResponseHomes()
        self.cards_seen = {}
        self.legs = Legs(
            pool, admission, self.health, self.headers, self.upstream, metrics, on_release
        )
        self.forwarder = Forwarder(
            cfg, pool, self.legs, self.health, self.headers, self.tenancy, metrics, self
        )
        self._metrics = metrics
        # The relay's calls, bound once (a stream makes them per leg, not per event).
        self.open_upstream = self.legs.open
        self.release = self.legs.release
        self.upstream_failed = self.health.upstream_failed
        self.ttfb_limit = self.health.ttfb_limit
        self.observe_ttfb = self.health.observe_ttfb
        self.alive = self.health.alive
        self.first_byte_patience = self.health.first_byte_patience
        self.watch_streams = self.health.watch_streams
        self.response_headers = self.headers.response
        self.upstream_headers = self.headers.upstream

    @property
    def metrics(self) -> GatewayMetrics:  # type: ignore[override]
        return self._metrics

    @metrics.setter
    def metrics(self, m: GatewayMetrics) -> None:
        self._metrics = m
        for part in (self.health, self.tenancy, self.legs, self.forwarder):
            part.metrics = m

    @property
    def on_hang(self) -> Callable[[Endpoint], None] | None:
        """Where an endpoint caught hanging goes (the prober's `suspect`, or the main
        process)."""
        return self.health.on_hang

    @on_hang.setter
    def on_hang(self, f: Callable[[Endpoint], None] | None) -> None:
        self.health.on_hang = f

    @property
    def tenants(self) -> Tenants | None:
        return self.tenancy.tenants

    @tenants.setter
    def tenants(self, t: Tenants | None) -> None:
        self.tenancy.tenants = t

    @property
    def limiter(self) -> Limiter | None:
        return self.tenancy.limiter

    @limiter.setter
    def limiter(self, lim: Limiter | None) -> None:
        self.tenancy.limiter = lim

    # -- what a relay needs besides the parts above (`_stream.RelayHost`) ---------------------
    def could_serve(self, model: str, priority: str, exclude: list[Endpoint]) -> bool:
        return self.pool.could_serve(model, priority, exclude)

    async def detokenize(
        self, model: str, ids: list[int], exclude: list[Endpoint], headers: dict[str, str]
    ) -> str | None:
        """The text of `ids` as a ready endpoint of `model` (not in `exclude`) decodes it;
        None when none answers."""
        ep = next(
            (
                e
                for e in self.pool.endpoints.values()
                if e.state == State.READY and e.healthy and model in e.models and e not in exclude
            ),
            None,
        )
        if ep is None or self.session is None:
            return None
        try:
            async with self.session.post(
                ep.url + "/detokenize",
                data=orjson.dumps({"model": model, "tokens": ids}),
                headers=self.headers.upstream(headers, ep),
                timeout=aiohttp.ClientTimeout(total=2.0),
            ) as r:
                if r.status != 200:
                    return None
                text = orjson.loads(await r.read()).get("prompt")
        except (*UPSTREAM_ERRORS, orjson.JSONDecodeError, AttributeError):
            return None
        return text if isinstance(text, str) else None

    def stream_sink(self, request: web.Request, resp: web.StreamResponse) -> ClientSink:
        """The sink of a stream's client, counted in the buffered-bytes gauge and the budget
        until `drop_sink`."""
        sink = ClientSink(resp, request.transport, self.cfg.stream_buffer_bytes, self.buffer_budget)
        self.sinks.add(sink)
        return sink

    def drop_sink(self, sink: ClientSink) -> None:
        sink.detach()
        self.sinks.discard(sink)
