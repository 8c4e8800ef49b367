"""Percentiles and window summaries of load records."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from typing import Any

from unbroken.bench.load import Record

__all__ = ["nearest_rank", "percentile", "summarize"]

PCTS = (50, 90, 99, 99.9)


def nearest_rank(n: int, p: float) -> int:
    """The index, in `n` sorted samples, of their nearest-rank `p` percentile."""
    return max(0, min(n - 1, math.ceil(p * n / 100 - 1e-9) - 1))


def percentile(xs: list[float], p: float) -> float | None:
    """Nearest-rank percentile (no interpolation: p99.9 of 1,000 samples is a real sample)."""
    if not xs:
        return None
    return sorted(xs)[nearest_rank(len(xs), p)]


def summarize(
    records: Iterable[Record], start: float = 0.0, end: float = math.inf
) -> dict[str, Any]:
    """Requests that started in [start, end): outcomes and latency percentiles (seconds)."""
    rs = [r for r in records if start <= r.start < end]
    outcomes = Counter(r.outcome for r in rs)
    ttft = [r.ttft for r in rs if r.ttft is not None]
    tpot = [t for r in rs if (t := r.tpot) is not None]
    e2e = [r.e2e for r in rs if r.e2e is not None and r.outcome == "ok"]
    itl = [g for r in rs for g in r.gaps]
    tokens = sum(r.tokens for r in rs)
    span = (max((r.end or r.start) for r in rs) - min(r.start for r in rs)) if rs else 0.0
    # Requests sent per second over the span of their sends (an open loop's achieved rate).
    starts = (max(r.start for r in rs) - min(r.start for r in rs)) if len(rs) > 1 else 0.0
    return {
        "window": [start, None if end == math.inf else end],
        "requests": len(rs),
        "outcomes": dict(outcomes),
        "dropped": outcomes.get("dropped", 0),
        "corrupted": outcomes.get("corrupted", 0),
        "tokens": tokens,
        "tokens_per_s": tokens / span if span > 0 else 0.0,
        "requests_per_s": (len(rs) - 1) / starts if starts > 0 else 0.0,
        "ttft": {f"p{p:g}": percentile(ttft, p) for p in PCTS},
        "itl": {f"p{p:g}": percentile(itl, p) for p in PCTS},
        "tpot": {f"p{p:g}": percentile(tpot, p) for p in PCTS},
        "e2e": {f"p{p:g}": percentile(e2e, p) for p in PCTS},
        # Open loop under --max-concurrency: the wait in the client before the send.
        "wait": {f"p{p:g}": percentile([r.wait for r in rs], p) for p in PCTS},
    }
