"""Gateway metrics (`unbroken_gateway_*`). Per-endpoint gauges are read from the pool at
scrape time by a collector, so the request path never touches them."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator, Sized
from typing import Any

from aiohttp import web
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from unbroken.gateway._admission import PRIORITIES, Admission
from unbroken.gateway._pool import CONDITIONS, Pool, State
from unbroken.wire.errors import ApiError
from unbroken.wire.metrics import register_standard_metrics

__all__ = ["GatewayMetrics"]

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
BREAK_REASONS = ("reset", "truncated", "stall", "error_event", "drain_deadline", "rebalance")
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
)
METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS")


class _PrefixCollector(Collector):
    """The prefix index's own estimate of its hit rate, from the policy's counters (summed
    over workers like every counter); nothing when the policy keeps no index."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[CounterMetricFamily]:
        pol = self.pool.policy
        lookup, hit = getattr(pol, "lookup_blocks", None), getattr(pol, "hit_blocks", None)
        if not isinstance(lookup, int) or not isinstance(hit, int):
            return
        yield CounterMetricFamily(
            "unbroken_gateway_prefix_lookup_blocks",
            "Prompt blocks (prefix_block_chars each) of the legs admitted by a prefix-aware "
            "policy.",
            value=lookup,
        )
        yield CounterMetricFamily(
            "unbroken_gateway_prefix_hit_blocks",
            "Of those, the leading blocks the gateway's prefix index credited to the replica "
            "chosen: its estimate of the engines' prefix-cache hits.",
            value=hit,
        )


class _PoolCollector(Collector):
    def __init__(self, pool: Pool, admission: Admission, sinks: Sized | None = None) -> None:
        self.pool = pool
        self.admission = admission
        self.sinks = sinks

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["endpoint", "pool"]
        inflight = GaugeMetricFamily(
            "unbroken_gateway_inflight", "Requests in flight per endpoint.", labels=labels
        )
        cap = GaugeMetricFamily(
            "unbroken_gateway_endpoint_cap", "In-flight cap per endpoint.", labels=labels
        )
        load = GaugeMetricFamily(
            "unbroken_gateway_endpoint_load",
            "Load score used for picking (in-flight + waiting + KV).",
            labels=labels,
        )
        state = GaugeMetricFamily(
            "unbroken_gateway_endpoint_state",
            "1 for the endpoint's current state.",
            labels=[*labels, "state"],
        )
        healthy = GaugeMetricFamily(
            "unbroken_gateway_endpoint_healthy",
            "1 when the endpoint passes its health checks.",
            labels=labels,
        )
        condition = GaugeMetricFamily(
            "unbroken_gateway_endpoint_condition",
            "1 for the condition the controller last set (normal, contended, recovering).",
            labels=[*labels, "condition"],
        )
        slow = GaugeMetricFamily(
            "unbroken_gateway_endpoint_slow_clients",
            "Streams of this endpoint whose client is behind by 64 KiB or more.",
            labels=labels,
        )
        for e in list(self.pool.endpoints.values()):
            lv = [e.name, e.pool]
            for c in CONDITIONS:
                condition.add_metric([*lv, c], 1 if e.condition == c else 0)
            slow.add_metric(lv, e.slow_clients)
            inflight.add_metric(lv, e.inflight)
            cap.add_metric(lv, e.effective_cap(self.pool.default_cap))
            load.add_metric(lv, e.load)
            healthy.add_metric(lv, 1 if e.healthy else 0)
            for s in State:
                state.add_metric([*lv, str(s)], 1 if e.state == s else 0)
        depth = GaugeMetricFamily(
            "unbroken_gateway_queue_depth",
            "Requests waiting for a slot, by priority.",
            labels=["priority"],
        )
        queued = self.admission.queue_depth()
        for p in PRIORITIES:
            depth.add_metric([p], queued[p])
        buffered = GaugeMetricFamily(
            "unbroken_gateway_stream_buffered_bytes",
            "Bytes held for clients reading slower than their engine writes.",
        )
        buffered.add_metric([], sum(s.buffered for s in list(self.sinks or ())))
        streams = GaugeMetricFamily("unbroken_gateway_active_streams", "Streams being relayed.")
        streams.add_metric([], len(self.sinks or ()))
        demand = GaugeMetricFamily(
            "unbroken_gateway_pool_demand",
            "Per pool, sequences running on its endpoints plus requests queued for it (the "
            "first pool of their priority's route serving their model): the autoscaling "
            "signal, desired replicas = ceil(demand / target).",
            labels=["pool"],
        )
        want = self.admission.demand()
        for name in {*self.pool.pool_order, *want}:
            demand.add_metric([name], want.get(name, 0))
        yield from (
            inflight,
            cap,
            load,
            state,
            healthy,
            condition,
            slow,
            depth,
            buffered,
            streams,
            demand,
        )


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


class _HistChild:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, v: float) -> None:
        self.counts[bisect_left(self.bounds, v)] += 1
        self.sum += v

    def observe_zeros(self, k: int) -> None:
        """`k` observations of 0 (the tokens after the first of one read)."""
        self.counts[bisect_left(self.bounds, 0.0)] += k


class FastHistogram(Collector):
    """A labelled histogram for the per-token path: an observation is a bisect and two
    additions (prometheus_client's takes a lock per bucket and per sum, about 3x the time,
    which the gateway's single-threaded event loop does not need). Exposed the same way."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: list[str],
        buckets: tuple[float, ...],
        registry: CollectorRegistry,
    ) -> None:
        self.name, self.doc, self.labelnames = name, documentation, labelnames
        self.bounds = tuple(float(b) for b in buckets)
        self._children: dict[tuple[str, ...], _HistChild] = {}
        registry.register(self)

    def labels(self, *values: str) -> _HistChild:
        c = self._children.get(values)
        if c is None:
            c = self._children[values] = _HistChild(self.bounds)
        return c

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        fam = HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)
        les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        for values, c in list(self._children.items()):
            acc = 0
            buckets = []
            for le, n in zip(les, c.counts, strict=True):
                acc += n
                buckets.append((le, acc))
            fam.add_metric(list(values), buckets, c.sum)
        yield fam


class GatewayMetrics:
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

    def _init_pool(self, pool: str) -> None:
        for reason in BREAK_REASONS:
            self.dropped.labels(pool, reason)
        for status in STATUSES:
            for p in PRIORITIES:
                self.requests.labels(status, p, pool)

    def count_unknown_routes(self) -> Any:
        """Middleware: count requests that match no route (the router's 404) and answer them
        with what the routes are (the usual cause is a base URL with /v1 twice)."""

        @web.middleware
        async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
            if isinstance(request.match_info.http_exception, web.HTTPNotFound):
                method = request.method if request.method in METHODS else "other"
                self.unknown_routes.labels(method).inc()
                raise ApiError(
                    404,
                    f"no route {request.method} {request.path[:200]}: this server has POST "
                    "/v1/completions, POST /v1/chat/completions and GET /v1/models (a client's "
                    "base URL is http://HOST:PORT/v1)",
                    type="not_found_error",
                    code="unknown_route",
                )
            return await handler(request)

        return middleware


# Gauges that each worker holds for its own streams: the gateway's value is their sum. Every
# other gauge (endpoints, caps, queue depth, build info) is the main process's, which sees the
# shared admission table.
PER_WORKER_GAUGES = frozenset(
    {
        "unbroken_gateway_active_streams",
        "unbroken_gateway_stream_buffered_bytes",
        "unbroken_gateway_endpoint_slow_clients",
        "unbroken_gateway_pool_demand",
    }
)


_Families = dict[str, tuple[str, str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]]


def merge_expositions(main: str, workers: list[str], retired: str = "") -> str:
    """One exposition for the whole gateway: the main process's families, with the workers'
    counters, histograms and per-worker gauges added up sample by sample; `retired` holds
    the counters of workers that have exited (see `retire`), so no counter ever goes back."""
    fams: _Families = {}
    _add(fams, main, lambda typ, name: True, summed=False)
    for text in (*workers, retired):
        _add(fams, text, lambda typ, name: typ in _SUMMED or name in PER_WORKER_GAUGES)
    return _render(fams)


def retire(retired: str, worker: str) -> str:
    """Fold an exited worker's last exposition into the retired counters: its counters,
    histograms and summaries are kept (what it served happened), its gauges are not (it holds
    no stream any more)."""
    fams: _Families = {}
    for text in (retired, worker):
        _add(fams, text, lambda typ, name: typ in _SUMMED)
    return _render(fams)


_SUMMED = ("counter", "histogram", "summary")


def _add(
    fams: _Families, text: str, keep: Callable[[str, str], bool], *, summed: bool = True
) -> None:
    """Parse `text` into `fams`: the families `keep(type, name)` accepts, each sample added
    to what is there (or, not `summed`, set)."""
    from prometheus_client.parser import text_string_to_metric_families

    for f in text_string_to_metric_families(text):
        if not keep(f.type, f.name):
            continue
        samples = fams.setdefault(f.name, (f.type, f.documentation, {}))[2]
        for s in f.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            samples[key] = samples.get(key, 0.0) + s.value if summed else s.value


def _render(fams: _Families) -> str:
    out: list[str] = []
    for name, (typ, doc, samples) in fams.items():
        doc = doc.replace("\\", r"\\").replace("\n", r"\n")
        # A counter's family is named with its _total, as prometheus_client writes it: under
        # the bare name, parsers (prometheus_client's, Prometheus's metadata) see an untyped
        # x_total series instead of a counter.
        fname = f"{name}_total" if typ == "counter" else name
        out.append(f"# HELP {fname} {doc}\n# TYPE {fname} {typ}\n")
        for (sname, labels), v in samples.items():
            lab = ",".join(
                '{}="{}"'.format(
                    k, str(val).replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
                )
                for k, val in labels
            )
            head = f"{sname}{{{lab}}}" if lab else sname
            out.append(f"{head} {floatToGoString(v)}\n")
    return "".join(out)
