"""Engine metrics under vLLM's names, meanings and buckets (vllm/v1/metrics/loggers.py), so
dashboards and the gateway's scraper work the same against the simulator and a real vLLM.

Injected faults are deliberately absent: whatever watches the engine must learn of contention
from what it measures (step times, CUDA call latency), as it would on a GPU node.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from unbroken.wire.metrics import register_standard_metrics

__all__ = ["EngineMetrics", "FinishedSeq", "LoraInfo"]

disable_created_metrics()

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to `max_value`."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class FinishedSeq:
    """The timestamps (monotonic) of one finished sequence, as vLLM's FinishedRequestStats:
    arrival at the API, first admission to the batch, first and last token."""

    __slots__ = ("arrival", "finish", "first", "generated", "last", "prompt", "scheduled")

    def __init__(
        self,
        *,
        arrival: float,
        scheduled: float,
        first: float,
        last: float,
        finish: float,
        prompt: int,
        generated: int,
    ) -> None:
        self.arrival, self.scheduled, self.first, self.last = arrival, scheduled, first, last
        self.finish, self.prompt, self.generated = finish, prompt, generated


class LoraInfo:
    """`vllm:lora_requests_info`, as vLLM's PrometheusStatLogger records it each step: a gauge
    labelled `max_lora`, `running_lora_adapters` and `waiting_lora_adapters` (adapter names,
    comma-joined) whose value is the wall-clock time it was last set. vLLM never removes a
    label set, so a scrape shows every combination seen and readers take the sample with the
    latest time; the simulator keeps the `keep` most recent ones (vLLM's grows unbounded)."""

    def __init__(self, registry: CollectorRegistry, max_lora: int, keep: int = 64) -> None:
        self.gauge = Gauge(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            registry=registry,
        )
        self.max_lora = str(max_lora)
        self.keep = keep
        self._seen: OrderedDict[tuple[str, str], None] = OrderedDict()

    def record(self, running: dict[str, int], waiting: dict[str, int]) -> None:
        key = (",".join(waiting), ",".join(running))
        self.gauge.labels(self.max_lora, *key).set(time.time())
        seen = self._seen
        seen[key] = None
        seen.move_to_end(key)
        while len(seen) > self.keep:
            old, _ = seen.popitem(last=False)
            self.gauge.remove(self.max_lora, *old)


class EngineMetrics:
    def __init__(
        self, model_name: str, max_model_len: int = 16_384, max_loras: int | None = None
    ) -> None:
        """`max_loras`: None when LoRA is disabled (vLLM then has no lora_requests_info)."""
        r = self.registry = CollectorRegistry()
        register_standard_metrics(r, "engine")
        labels = ["model_name", "engine"]
        self._lv = (model_name, "0")
        self.running = Gauge(
            "vllm:num_requests_running", "Requests in model execution batches.", labels, registry=r
        ).labels(*self._lv)
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Requests waiting to be processed.", labels, registry=r
        ).labels(*self._lv)
        self.kv_usage = Gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            labels,
            registry=r,
        ).labels(*self._lv)
        self.prefix_queries = Counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            labels,
            registry=r,
        ).labels(*self._lv)
        self.prefix_hits = Counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            labels,
            registry=r,
        ).labels(*self._lv)
        self.preemptions = Counter(
            "vllm:num_preemptions", "Cumulative preemptions.", labels, registry=r
        ).labels(*self._lv)
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=r,
        ).labels(*self._lv)
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            labels,
            buckets=ITL_BUCKETS,
            registry=r,
        ).labels(*self._lv)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of end-to-end request latency in seconds.",
            labels,
            buckets=E2E_BUCKETS,
            registry=r,
        ).labels(*self._lv)
        self.tpot = Histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            labels,
            buckets=ITL_BUCKETS,
            registry=r,
        ).labels(*self._lv)

        def latency(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, labels, buckets=E2E_BUCKETS, registry=r).labels(*self._lv)

        self.queue_time = latency(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
        )
        self.prefill_time = latency(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
        )
        self.decode_time = latency(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
        )
        self.inference_time = latency(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
        )
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = Histogram(
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            labels,
            buckets=token_buckets,
            registry=r,
        ).labels(*self._lv)
        self.request_generation_tokens = Histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            labels,
            buckets=token_buckets,
            registry=r,
        ).labels(*self._lv)
        self._success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=r,
        )
        for reason in ("stop", "length", "abort"):
            self._success.labels(*self._lv, reason)
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=r
        ).labels(*self._lv)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", labels, registry=r
        ).labels(*self._lv)
        self.weights_load = Gauge(
            "unbroken_engine_weights_load_seconds",
            "Time spent reading the weight files at start.",
            registry=r,
        )
        self.weights_bytes = Gauge(
            "unbroken_engine_weights_bytes", "Bytes of weights read at start.", registry=r
        )
        self.startup = Gauge(
            "unbroken_engine_startup_seconds", "Process start to /health answering.", registry=r
        )
        self.cuda_stub = Gauge(
            "unbroken_engine_cuda_stub_loaded",
            "1 when steps run inside the stand-in CUDA library.",
            registry=r,
        )
        self.lora: LoraInfo | None = None if max_loras is None else LoraInfo(r, max_loras)

    def success(self, finished_reason: str) -> None:
        self._success.labels(*self._lv, finished_reason).inc()

    def finished(self, f: FinishedSeq, finished_reason: str) -> None:
        """Per-sequence histograms, as vLLM records a finished request (n > 1 is n of them)."""
        self.success(finished_reason)
        self.e2e.observe(f.finish - f.arrival)
        self.queue_time.observe(f.scheduled - f.arrival)
        self.prefill_time.observe(f.first - f.scheduled)
        self.decode_time.observe(f.last - f.first)
        self.inference_time.observe(f.last - f.scheduled)
        self.request_prompt_tokens.observe(f.prompt)
        self.request_generation_tokens.observe(f.generated)
        if f.generated > 1:
            self.tpot.observe((f.last - f.first) / (f.generated - 1))
