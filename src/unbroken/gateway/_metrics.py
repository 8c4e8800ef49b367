"""Gateway metrics (`unbroken_gateway_*`): `GatewayMetrics` defines the registry, its
counters and histograms, and the label values exported at 0 from the start. Per-endpoint
gauges are read from the pool at scrape time by a collector (`_metrics_gauges`), so the
request path never touches them; the per-token histograms are `_metrics_histogram`'s; the
main process's merge of its workers' expositions is `_metrics_merge`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from aiohttp import web
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from unbroken.gateway._admission import PRIORITIES, Admission
from unbroken.gateway._metrics_gauges import _PoolCollector as _PoolCollector
from unbroken.gateway._metrics_gauges import _PrefixCollector as _PrefixCollector
from unbroken.gateway._metrics_histogram import FastHistogram
from unbroken.gateway._metrics_histogram import _HistChild as _HistChild
from unbroken.gateway._metrics_merge import _SUMMED as _SUMMED
from unbroken.gateway._metrics_merge import PER_WORKER_GAUGES, merge_expositions, retire
from unbroken.gateway._metrics_merge import _add as _add
from unbroken.gateway._metrics_merge import _Families as _Families
from unbroken.gateway._metrics_merge import _render as _render
from unbroken.gateway._pool import Pool
from unbroken.wire.errors import ApiError
from unbroken.wire.metrics import register_standard_metrics

# FastHistogram, PER_WORKER_GAUGES, merge_expositions and retire (and the private names
# imported above) are re-exported: they were defined here before the split (issue 22).
__all__ = [
    "PER_WORKER_GAUGES",
    "FastHistogram",
    "GatewayMetrics",
    "merge_expositions",
    "retire",
]

# vllm-router's worker routes, served on the admin port (`_admin.py`): a request for one on
# the public port is told where they are.
ROUTER_ADMIN_ROUTES = frozenset(
    {"/workers", "/list_workers", "/get_loads", "/add_worker", "/remove_worker"}
)

disable_created_metrics()

TTFT_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    10.0,
    20.0,
    60.0,
)
ITL_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1.0,
    2.0,
    5.0,
    10.0,
)
WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
# Label values known in advance, exported at 0 from the start so that `increase()` and
# `rate()` show 0 rather than "no data" (values outside these still appear when they occur).
SHED_CODES = ("shed", "queue_full", "queue_timeout")
# Why a stream's leg broke (`streams_migrated_total` / `streams_dropped_total`'s `reason`):
# every one exported at 0 from the start, so `increase()` of any has data.
BREAK_REASONS = (
    "reset",
    "truncated",
    "abort",
    "ttfb",
    "stall",
    "error_event",
    "drain_deadline",
    "rebalance",
)
UNMIGRATABLE = (
    "structured_output",
    "tools",
    "logprobs",
    "prompt_form",
    "suffix",
    "migration_limit",
    "no_endpoint",
)
STATUSES = ("200", "429", "503")
TENANT_REASONS = (
    "requests_per_minute",
    "prompt_tokens_per_minute",
    "completion_tokens_per_minute",
    "concurrent_streams",
    "request_too_large",
)
METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS")


class _PoolLabels(Collector):
    """Exports nothing; at each scrape it initialises the labelled children of the pools
    endpoints belong to, so a pool's counters read 0 from its first scrape."""

    def __init__(self, pool: Pool, metrics: GatewayMetrics) -> None:
        self.pool = pool
        self.metrics = metrics

    def collect(self) -> Iterator[GaugeMetricFamily]:
        for name in {e.pool for e in list(self.pool.endpoints.values())}:
            self.metrics.for_pool(name)
        return iter(())


class GatewayMetrics:
    """The gateway's registry: every counter and histogram it exports, the scrape-time
    collectors, and the label values that read 0 from the start."""

    def __init__(self, pool: Pool, admission: Admission, sinks: Any = None) -> None:
        r = self.registry = CollectorRegistry()
        r.register(_PoolLabels(pool, self))  # first: runs before the counters are collected
        self.requests = Counter(
            "unbroken_gateway_requests",
            "Requests answered.",
            ["status", "priority", "pool"],
            registry=r,
        )
        self.ttft = FastHistogram(
            "unbroken_gateway_ttft_seconds",
            "Time from request arrival to the first token event sent.",
            ["pool"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = FastHistogram(
            "unbroken_gateway_inter_token_seconds",
            "Gap between consecutive token events relayed.",
            ["pool"],
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "unbroken_gateway_queue_wait_seconds",
            "Time spent waiting for a slot.",
            ["priority"],
            buckets=WAIT_BUCKETS,
            registry=r,
        )
        self.upstream_errors = Counter(
            "unbroken_gateway_upstream_errors",
            "Errors talking to engines.",
            ["endpoint", "kind"],
            registry=r,
        )
        self.retries = Counter(
            "unbroken_gateway_retries",
            "Requests retried on another endpoint before their first byte.",
            ["reason"],
            registry=r,
        )
        self.dropped = Counter(
            "unbroken_gateway_streams_dropped",
            "Streams that ended without their finish.",
            ["pool", "reason"],
            registry=r,
        )
        self.migrated = Counter(
            "unbroken_gateway_streams_migrated",
            "Streams continued on another endpoint after their upstream broke.",
            ["reason"],
            registry=r,
        )
        self.unmigratable = Counter(
            "unbroken_gateway_streams_unmigratable",
            "Broken streams that could not be continued, by why.",
            ["reason"],
            registry=r,
        )
        self.late_workers = Gauge(
            "unbroken_gateway_metrics_late_workers",
            "Workers that did not answer the last /metrics scrape in time (stopped or starved);"
            " their previous exposition stood in.",
            registry=r,
        )
        # Which continuation each migration took: token ids (exact) or text (re-tokenized).
        self.migration_path = Counter(
            "unbroken_gateway_migration_path",
            "Migrations by how the continuation was built (tokens, text).",
            ["path"],
            registry=r,
        )
        self.shed = Counter(
            "unbroken_gateway_shed",
            "Requests refused for lack of capacity.",
            ["priority", "reason"],
            registry=r,
        )
        self.slow_clients = Counter(
            "unbroken_gateway_slow_client_aborts",
            "Streams cut because the client fell further behind than the per-stream buffer allows.",
            registry=r,
        )
        self.client_disconnects = Counter(
            "unbroken_gateway_client_disconnects",
            "Clients that left before their stream ended.",
            registry=r,
        )
        # Counted by the main process (workers report each one): an old worker's own counters
        # leave /metrics with it.
        self.handed_over = Counter(
            "unbroken_gateway_streams_handed_over",
            "Streams handed with their client connection to a new worker at a reload: out of "
            "an old worker, in to a new one.",
            ["direction"],
            registry=r,
        )
        r.register(_PoolCollector(pool, admission, sinks))
        r.register(_PrefixCollector(pool))
        self._pool_children: dict[str, tuple[Any, Any]] = {}
        self.unknown_routes = Counter(
            "unbroken_gateway_unknown_route_requests",
            "Requests to paths the gateway does not serve (404), by method: a client with a "
            "wrong base URL shows here.",
            ["method"],
            registry=r,
        )
        # Tenants (issue 25): labelled by the spec's tenant names only (plus `none` for
        # requests with no tenant), never by key.
        self.tenant_requests = Counter(
            "unbroken_gateway_tenant_requests",
            "Requests answered, by tenant and status (429: a limit or capacity; 401 counts "
            "under tenant none).",
            ["tenant", "status"],
            registry=r,
        )
        self.tenant_tokens = Counter(
            "unbroken_gateway_tenant_tokens",
            "Tokens charged to a tenant as the engines reported them (kind: prompt, "
            "completion; a continued stream's tokens once).",
            ["tenant", "kind"],
            registry=r,
        )
        self.tenant_rejections = Counter(
            "unbroken_gateway_tenant_rejections",
            "Requests refused by a tenant's limits (reason: the limit) or for want of a "
            "valid key (invalid_api_key, tenant none).",
            ["tenant", "reason"],
            registry=r,
        )
        self.tenant_queue_wait = Histogram(
            "unbroken_gateway_tenant_queue_wait_seconds",
            "Time each request of a tenant waited for a slot (0 when it waited none).",
            ["tenant"],
            buckets=WAIT_BUCKETS,
            registry=r,
        )
        register_standard_metrics(r, "gateway")
        self._init_labels()

    def for_pool(self, pool: str) -> tuple[Any, Any]:
        """(ttft, itl) histogram children for a pool; cached, since `labels()` is not free."""
        c = self._pool_children.get(pool)
        if c is None:
            c = self._pool_children[pool] = (self.ttft.labels(pool), self.itl.labels(pool))
            self._init_pool(pool)
        return c

    def _init_labels(self) -> None:
        for p in PRIORITIES:
            self.queue_wait.labels(p)
            for code in SHED_CODES:
                self.shed.labels(p, code)
        for reason in BREAK_REASONS:
            self.migrated.labels(reason)
        for why in UNMIGRATABLE:
            self.unmigratable.labels(why)
        for path in ("tokens", "text"):
            self.migration_path.labels(path)
        for direction in ("out", "in"):
            self.handed_over.labels(direction)
        for m in METHODS:
            self.unknown_routes.labels(m)

    def init_tenants(self, names: list[str]) -> None:
        """Every tenant's series at 0 from the start (a bounded set: the spec's names)."""
        for name in names:
            for status in STATUSES:
                self.tenant_requests.labels(name, status)
            for kind in ("prompt", "completion"):
                self.tenant_tokens.labels(name, kind)
            for reason in TENANT_REASONS:
                self.tenant_rejections.labels(name, reason)
            self.tenant_queue_wait.labels(name)
        self.tenant_rejections.labels("none", "invalid_api_key")
        self.tenant_requests.labels("none", "401")

    def _init_pool(self, pool: str) -> None:
        for reason in BREAK_REASONS:
            self.dropped.labels(pool, reason)
        for status in STATUSES:
            for p in PRIORITIES:
                self.requests.labels(status, p, pool)

    def count_unknown_routes(self, check: Callable[[web.Request], None] | None = None) -> Any:
        """Middleware: count requests that match no route (the router's 404) and answer them
        with what the routes are (the usual cause is a base URL with /v1 twice). `check` is
        called first on any request without a route (404 or 405): it may refuse it (401)."""

        @web.middleware
        async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
            unrouted = request.match_info.http_exception
            if unrouted is not None and check is not None:
                check(request)
            if isinstance(unrouted, web.HTTPNotFound):
                method = request.method if request.method in METHODS else "other"
                self.unknown_routes.labels(method).inc()
                if request.path in ROUTER_ADMIN_ROUTES:
                    raise ApiError(
                        404,
                        f"{request.path} (vllm-router's worker route) is on the gateway's admin "
                        "port, with its bearer token: Authorization: Bearer <admin token>",
                        code="unknown_route",
                    )
                raise ApiError(
                    404,
                    f"no route {request.method} {request.path[:200]}: this server has POST "
                    "/v1/completions, POST /v1/chat/completions, GET /v1/models and vLLM's "
                    "other routes (/v1/embeddings, /v1/responses, /tokenize, ...; a client's "
                    "base URL is http://HOST:PORT/v1)",
                    code="unknown_route",
                )
            return await handler(request)

        return middleware
