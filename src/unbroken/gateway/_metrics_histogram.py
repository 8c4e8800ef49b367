"""The gateway's histogram for the per-token path (`FastHistogram`): the relay observes
every token's time into it (`_stream`), so an observation is kept to a bisect and two
additions; exposed like prometheus_client's own. Registered by `_metrics.GatewayMetrics`.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

__all__ = ["FastHistogram"]


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
