"""The gauges read at scrape time (`_PoolCollector`: endpoints, queue, streams, demand;
`_PrefixCollector`: the prefix index's estimated hits), from the pool, the admission queue
and the client sinks as they are then, so the request path never updates a gauge. Registered
by `_metrics.GatewayMetrics`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from unbroken.gateway._admission import PRIORITIES, Admission
from unbroken.gateway._pool import CONDITIONS, Pool, State

__all__ = ["_PoolCollector", "_PrefixCollector"]


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
    """Per-endpoint gauges (in flight, cap, load, state, health, condition, slow clients)
    and requests served, the queue's depth by priority, the streams and their buffered
    bytes, and each pool's demand (the autoscaling signal)."""

    def __init__(self, pool: Pool, admission: Admission, sinks: Sized | None = None) -> None:
        self.pool = pool
        self.admission = admission
        self.sinks = sinks

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        labels = ["endpoint", "pool"]
        inflight = GaugeMetricFamily(
            "unbroken_gateway_inflight", "Requests in flight per endpoint.", labels=labels
        )
        cap = GaugeMetricFamily(
            "unbroken_gateway_endpoint_cap", "In-flight cap per endpoint.", labels=labels
        )
        load = GaugeMetricFamily(
            "unbroken_gateway_endpoint_load",
            "Load score used for picking (in-flight + the engine queue or other gateways' "
            "legs + KV).",
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
        # A counter read at scrape time: the legs admitted ever, in every worker (the shared
        # table's count, which only the main process reports: `_metrics_merge.MAIN_ONLY`).
        served = CounterMetricFamily(
            "unbroken_gateway_endpoint_requests",
            "Legs admitted to the endpoint (requests, their retries and continuations), as "
            "vllm-router's vllm_router_processed_requests_total per worker; starts again "
            "when an endpoint is removed and added back.",
            labels=labels,
        )
        for e in list(self.pool.endpoints.values()):
            lv = [e.name, e.pool]
            served.add_metric(lv, e.slot.served())
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
            served,
            depth,
            buffered,
            streams,
            demand,
        )
