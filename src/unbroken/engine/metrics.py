"""Engine metrics under vLLM's names and meanings, so dashboards and the gateway's scraper
work the same against the simulator and a real vLLM."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

__all__ = ["EngineMetrics"]

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


class EngineMetrics:
    def __init__(self, model_name: str) -> None:
        r = self.registry = CollectorRegistry()
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
        self._success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=r,
        )
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
        self.faults = Gauge(
            "unbroken_engine_fault_active", "Active injected faults.", ["kind"], registry=r
        )

    def success(self, finished_reason: str) -> None:
        self._success.labels(*self._lv, finished_reason).inc()
