"""Signals the controller reads, turned into per-window numbers per endpoint.

Sources are Prometheus text expositions read every interval (never a 15 s scrape): the
agent's in-kernel CUDA call histograms and socket backpressure counters, and each engine's
own vLLM metrics. Counters and histograms are differenced between two reads, series by series
(so a restarted process, whose counters start again at 0, never yields a negative window),
then summed per endpoint.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from unbroken.wire.metrics import filtered_path

__all__ = [
    "ENGINE_METRICS_PATH",
    "LAUNCH_FUNCTIONS",
    "CudaWindow",
    "EngineWindow",
    "HistogramDelta",
    "Sample",
    "agent_windows",
    "engine_window",
    "parse_text",
]

# Host-side launch and copy calls: their latency is a few microseconds whatever the batch, and
# grows when the bus or the driver is contended. Synchronize calls are left out on purpose:
# they wait for the device's work, so they grow with load, not with contention.
LAUNCH_FUNCTIONS = frozenset(
    {
        "cudaLaunchKernel",
        "cudaGraphLaunch",
        "cudaMemcpyAsync",
        "cuLaunchKernel",
        "cuLaunchKernelEx",
        "cuGraphLaunch",
        "cuMemcpyHtoDAsync_v2",
        "cuMemcpyDtoHAsync_v2",
    }
)

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: tuple[tuple[str, str], ...]
    value: float

    def label(self, key: str) -> str:
        for k, v in self.labels:
            if k == key:
                return v
        return ""


def parse_text(text: str, prefixes: Iterable[str]) -> Iterator[Sample]:
    """Samples whose metric name starts with one of `prefixes` (a fast path: the agent's
    exposition can hold thousands of series and is read four times a second)."""
    pre = tuple(prefixes)
    for line in text.splitlines():
        if not line or line[0] == "#" or not line.startswith(pre):
            continue
        m = _LINE.match(line)
        if m is None:
            continue
        try:
            value = float(m.group(4))
        except ValueError:
            continue
        labels = tuple(_LABEL.findall(m.group(3))) if m.group(3) else ()
        yield Sample(m.group(1), labels, value)


class HistogramDelta:
    """Per-series differences of cumulative counters between successive reads."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}

    def delta(self, s: Sample) -> float:
        key = (s.name, s.labels)
        prev = self._last.get(key)
        self._last[key] = s.value
        if prev is None:
            return math.nan  # first sight: no window yet
        return s.value - prev if s.value >= prev else s.value  # reset: counts since restart


@dataclass
class CudaWindow:
    """One endpoint's launch/copy calls in one window: a cumulative histogram by bucket
    upper bound (seconds), and backpressure socket-seconds."""

    buckets: dict[float, float] = field(default_factory=dict)
    count: float = 0.0
    backpressure_s: float = 0.0

    def merge(self, other: CudaWindow) -> CudaWindow:
        out = CudaWindow(dict(self.buckets), self.count + other.count,
                         self.backpressure_s + other.backpressure_s)  # fmt: skip
        for le, n in other.buckets.items():
            out.buckets[le] = out.buckets.get(le, 0.0) + n
        return out

    def quantile(self, q: float) -> float | None:
        """The q-quantile in seconds, interpolated geometrically inside its log2 bucket."""
        if self.count <= 0:
            return None
        rank = q * self.count
        lower, below = 0.0, 0.0
        for le in sorted(self.buckets):
            cum = self.buckets[le]
            if cum >= rank:
                if math.isinf(le):
                    return lower
                inside = cum - below
                frac = 0.5 if inside <= 0 else (rank - below) / inside
                lo = lower if lower > 0 else le / 2
                return lo * (le / lo) ** frac
            lower, below = le, cum
        return lower


def agent_windows(
    text: str, deltas: HistogramDelta, functions: frozenset[str] = LAUNCH_FUNCTIONS
) -> tuple[dict[str, CudaWindow], bool]:
    """(endpoint → window, eBPF loaded) from one read of the agent's /metrics. Series with no
    endpoint label (processes that are not ours) are ignored."""
    out: dict[str, CudaWindow] = {}
    ebpf = False
    for s in parse_text(
        text,
        (
            "unbroken_cuda_call_duration_seconds_bucket",
            "unbroken_socket_backpressure_seconds",
            "unbroken_agent_ebpf",
        ),
    ):
        if s.name == "unbroken_agent_ebpf":
            ebpf = s.value >= 1
            continue
        ep = _endpoint(s)
        if not ep:
            continue
        if s.name.endswith("_bucket"):
            if s.label("function") not in functions:
                continue
            d = deltas.delta(s)
            if math.isnan(d):
                continue
            le = s.label("le")
            bound = math.inf if le == "+Inf" else float(le)
            w = out.setdefault(ep, CudaWindow())
            w.buckets[bound] = w.buckets.get(bound, 0.0) + d
            if math.isinf(bound):
                w.count += d
        elif s.name.startswith("unbroken_socket_backpressure_seconds"):
            d = deltas.delta(s)
            if not math.isnan(d):
                out.setdefault(ep, CudaWindow()).backpressure_s += d
    return out, ebpf


def _endpoint(s: Sample) -> str:
    """The gateway's name for the process: the agent's `endpoint` label beside `unbroken up`;
    on Kubernetes `POD.NAMESPACE`, the name EndpointSlice discovery gives it."""
    ep = s.label("endpoint")
    if ep:
        return ep
    pod, ns = s.label("pod"), s.label("namespace")
    return f"{pod}.{ns}" if pod and ns else pod


@dataclass
class EngineWindow:
    """One endpoint's vLLM metrics over one window."""

    itl_sum: float = 0.0
    itl_count: float = 0.0
    ttft_sum: float = 0.0
    ttft_count: float = 0.0
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0

    @property
    def itl_mean(self) -> float | None:
        return self.itl_sum / self.itl_count if self.itl_count > 0 else None

    @property
    def ttft_mean(self) -> float | None:
        return self.ttft_sum / self.ttft_count if self.ttft_count > 0 else None


# vLLM renamed its per-token latency histogram; accept both (older servers expose only the
# second one).
_ITL = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")
_TTFT = "vllm:time_to_first_token_seconds"
# Only these lines are parsed: a vLLM 0.32 page is ~40 KB, mostly histogram buckets, and the
# controller reads every engine's five times a second.
_ENGINE_LINES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    *(f"{base}_{kind}" for base in (*_ITL, _TTFT) for kind in ("sum", "count")),
)
# ... and only these are asked for (`wire.metrics.FilteredReads`): an engine that honours
# the filter (the simulator) renders them instead of its whole page, ~1 ms of its process
# against ~6 ms, five times a second per engine; in the demo that read held the simulator's
# loop while requests waited. vLLM 0.32 ignores the query (its /metrics is
# prometheus-fastapi-instrumentator's) and sends the whole page, which parses the same.
ENGINE_METRICS_PATH = filtered_path(_ENGINE_LINES)


def engine_window(text: str, deltas: HistogramDelta) -> EngineWindow:
    w = EngineWindow()
    sums: dict[str, list[float]] = {}  # histogram base name -> [sum, count] this window
    for s in parse_text(text, _ENGINE_LINES):
        name = s.name
        if name == "vllm:num_requests_running":
            w.running += s.value
        elif name == "vllm:num_requests_waiting":
            w.waiting += s.value
        elif name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
            w.kv_usage = max(w.kv_usage, s.value)
        elif name.endswith(("_sum", "_count")):
            base, _, kind = name.rpartition("_")
            if base in _ITL or base == _TTFT:
                d = deltas.delta(s)
                if not math.isnan(d):
                    pair = sums.setdefault(base, [0.0, 0.0])
                    pair[0 if kind == "sum" else 1] += d
    for base in _ITL:
        if base in sums and sums[base][1] > 0:
            w.itl_sum, w.itl_count = sums[base]
            break
    if _TTFT in sums:
        w.ttft_sum, w.ttft_count = sums[_TTFT]
    return w
