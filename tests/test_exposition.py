"""`wire.exposition.render_text` writes exactly what prometheus_client's `generate_latest`
writes: the same bytes for the project's own registries (the engine simulator's vLLM set,
with and without `_created`, filtered by name), for every metric kind, and for label values
that need escaping."""

from __future__ import annotations

import time
from collections.abc import Iterable

import prometheus_client.metrics as prom_metrics
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Enum,
    Gauge,
    Histogram,
    Info,
    Summary,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from unbroken.engine.metrics import CREATED, EngineMetrics, FinishedSeq
from unbroken.wire.exposition import render_text
from unbroken.wire.metrics import register_standard_metrics


class _Frozen(Collector):
    """One collection of `reg`, rendered twice: a live registry's process_* series (CPU
    seconds, memory) move between two renders."""

    def __init__(self, reg: Collector) -> None:
        self.metrics = list(reg.collect())

    def collect(self) -> Iterable[Metric]:
        return self.metrics


def _same(reg: Collector) -> None:
    frozen = _Frozen(reg)
    assert render_text(frozen) == generate_latest(frozen)


def test_the_engine_simulators_vllm_registry_byte_for_byte() -> None:
    m = EngineMetrics("org/model-a", max_loras=2)
    now = time.monotonic()
    for i in range(40):
        m.finished(
            FinishedSeq(
                arrival=now,
                scheduled=now + 0.001 * i,
                first=now + 0.01 * i,
                last=now + 0.02 * i,
                finish=now + 0.03 * i,
                prompt=10 + i,
                generated=i,
                cached=i // 2,
                max_tokens=64,
            ),
            "stop" if i % 3 else "length",
        )
    was = prom_metrics._use_created
    for created in (CREATED, False):
        prom_metrics._use_created = created
        try:
            _same(m.registry)
            _same(m.registry.restricted_registry(["vllm:num_requests_running"]))
            _same(m.registry.restricted_registry(["vllm:time_to_first_token_seconds_bucket"]))
        finally:
            prom_metrics._use_created = was


def test_every_kind_of_metric() -> None:
    r = CollectorRegistry()
    register_standard_metrics(r, "test")
    c = Counter("c_requests", "Requests.\nSecond line \\ backslash", ["code"], registry=r)
    c.labels("200").inc(3)
    c.labels("5xx").inc(0.5)
    Gauge("g", "A gauge.", registry=r).set(1e21)
    Gauge("g_small", "Tiny.", registry=r).set(-1.5e-9)
    h = Histogram("h_seconds", "H.", ["route"], buckets=(0.001, 0.5, 2.0), registry=r)
    for v in (0.0001, 0.3, 7):
        h.labels("/v1/chat").observe(v)
    Summary("s", "S.", registry=r).observe(2)
    Info("build", "Build.", registry=r).info({"version": "1.2", "commit": 'a"b'})
    e = Enum("state", "State.", states=["up", "down"], registry=r)
    e.state("down")
    _same(r)


class _Custom(Collector):
    def __init__(self, values: Iterable[str]) -> None:
        self.values = list(values)

    def collect(self) -> Iterable[Metric]:
        g = GaugeMetricFamily("custom_gauge", "Custom.", labels=["who", "le"])
        for i, v in enumerate(self.values):
            g.add_metric([v, str(i)], float(i))
        yield g
        h = HistogramMetricFamily("custom_hist", "Hist.", labels=["function"])
        h.add_metric(["cuLaunchKernel"], [("0.001", 1), ("+Inf", 4)], 0.25)
        yield h
        t = GaugeMetricFamily("custom_stamped", "With a timestamp (the slow path).")
        t.add_metric([], 2.0, timestamp=1700000000.5)
        yield t


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(max_size=12), max_size=6))
def test_label_values_that_need_escaping(values: list[str]) -> None:
    _same(_Custom([*values, 'q"uote', "new\nline", "back\\slash", "ünïcode", ""]))
