"""Engine metrics under vLLM's names, meanings and buckets (vllm/v1/metrics/loggers.py), so
dashboards and the gateway's scraper work the same against the simulator and a real vLLM.

Injected faults are deliberately absent: whatever watches the engine must learn of contention
from what it measures (step times, CUDA call latency), as it would on a GPU node.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import prometheus_client.metrics as prom_metrics
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from unbroken.wire.exposition import render_text
from unbroken.wire.metrics import register_standard_metrics

__all__ = ["EngineMetrics", "FinishedSeq", "LoraInfo", "cache_config_info"]

# vLLM's API server renders prometheus_client's default REGISTRY with its `_created` samples
# (one per counter and histogram series) unless PROMETHEUS_DISABLE_CREATED_SERIES says not to.
CREATED = prom_metrics._get_use_created()

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
    160.0,
    640.0,
    2560.0,
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
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
# vllm/v1/engine/__init__.py FinishReason; vllm/v1/metrics/stats.py PromptTokenStats.ALL_SOURCES;
# vllm/v1/metrics/cache_hit_source.py CacheHitSource; vllm/v1/metrics/loggers.py ADMISSION_REASONS.
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
CACHE_HIT_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")
# vLLM 0.32's CacheConfig().metrics_info() (every field, as str), the labels of
# vllm:cache_config_info besides `engine`; cache_config_info() fills in the simulator's own.
CACHE_CONFIG_DEFAULTS: dict[str, str] = {
    "block_size": "16",
    "user_specified_block_size": "False",
    "kv_cache_layout": "None",
    "prefix_match_unit": "None",
    "gpu_memory_utilization": "0.92",
    "cache_dtype": "auto",
    "is_attention_free": "False",
    "num_gpu_blocks_override": "None",
    "sliding_window": "None",
    "enable_prefix_caching": "True",
    "prefix_caching_hash_algo": "sha256",
    "prefix_cache_retention_interval": "0",
    "kv_cache_dtype_skip_layers": "[]",
    "mamba_page_size_padded": "None",
    "skip_page_size_padded": "None",
    "mamba_block_size": "None",
    "mamba_cache_dtype": "auto",
    "mamba_ssm_cache_dtype": "auto",
    "mamba_cache_mode": "none",
    "enable_mamba_shared_prefix_checkpoint": "False",
    "replayssm_buffer_len": "16",
    "use_replayssm": "False",
    "use_kda_recoverssm": "False",
    "num_gpu_blocks": "None",
    "num_cpu_blocks": "None",
    "effective_attention_block_size": "None",
    "kv_cache_size_tokens": "None",
    "kv_cache_max_concurrency": "None",
    "hash_block_size": "None",
    "cache_hit_alignment_tokens": "None",
    "kv_sharing_fast_prefill": "False",
    "swa_bounded_replay": "True",
    "kv_cache_memory_bytes": "None",
    "kv_offloading_size": "None",
    "kv_offloading_backend": "native",
    "_block_size_resolved": "True",
}


def cache_config_info(
    *, block_size: int, num_blocks: int, enable_prefix_caching: bool, max_model_len: int
) -> dict[str, str]:
    """vllm:cache_config_info's labels for the simulator's KV cache: vLLM's defaults, with the
    values its engine fills in after profiling (blocks, size in tokens, max concurrency as
    kv_cache_size_tokens / max_model_len) taken from the simulated cache."""
    size = num_blocks * block_size
    return CACHE_CONFIG_DEFAULTS | {
        "block_size": str(block_size),
        "user_specified_block_size": str(block_size != 16),
        "enable_prefix_caching": str(enable_prefix_caching),
        "num_gpu_blocks": str(num_blocks),
        "kv_cache_size_tokens": str(size),
        "kv_cache_max_concurrency": str(size / max_model_len),
    }


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
    arrival at the API, first admission to the batch, first and last token; its token counts
    (prompt, of them found in the prefix cache, generated), its max_tokens and preemptions."""

    __slots__ = (
        "arrival",
        "cached",
        "finish",
        "first",
        "generated",
        "last",
        "max_tokens",
        "preemptions",
        "prompt",
        "scheduled",
    )

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
        cached: int = 0,
        max_tokens: int = 0,
        preemptions: int = 0,
    ) -> None:
        self.arrival, self.scheduled, self.first, self.last = arrival, scheduled, first, last
        self.finish, self.prompt, self.generated = finish, prompt, generated
        self.cached, self.max_tokens, self.preemptions = cached, max_tokens, preemptions


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
        # A sample from the start (nothing running or waiting), not only after the first
        # step: a reader that asks for this series by name (`?name[]=`, the gateway's
        # prober) sees an engine that serves adapters before any request has run on it.
        self.record({}, {})

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
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            labels,
            registry=r,
        ).labels(*self._lv)
        self.waiting = Gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            labels,
            registry=r,
        ).labels(*self._lv)
        by_reason = Gauge(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
            "scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, "
            "KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
            [*labels, "reason"],
            registry=r,
        )
        self.waiting_capacity = by_reason.labels(*self._lv, "capacity")
        self.waiting_deferred = by_reason.labels(*self._lv, "deferred")
        sleep = Gauge(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is "
            "awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep "
            "level 2.",
            [*labels, "sleep_state"],
            registry=r,
        )
        # The simulator never sleeps (no /sleep endpoint): vLLM's default values.
        for state, value in (("awake", 1), ("weights_offloaded", 0), ("discard_all", 0)):
            sleep.labels(*self._lv, state).set(value)
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
        # Registered by vLLM whatever the configuration; the simulator has no KV connector,
        # multi-modal input or MFU estimate, so they stay at 0 as on a vLLM without those.
        for name, doc in (
            (
                "vllm:external_prefix_cache_queries",
                "External prefix cache queries from KV connector cross-instance cache sharing, "
                "in terms of number of queried tokens.",
            ),
            (
                "vllm:external_prefix_cache_hits",
                "External prefix cache hits from KV connector cross-instance cache sharing, "
                "in terms of number of cached tokens.",
            ),
            (
                "vllm:mm_cache_queries",
                "Multi-modal cache queries, in terms of number of queried items.",
            ),
            ("vllm:mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items."),
            (
                "vllm:estimated_flops_per_gpu_total",
                "Estimated number of floating point operations per GPU (for Model Flops "
                "Utilization calculations).",
            ),
            (
                "vllm:estimated_read_bytes_per_gpu_total",
                "Estimated number of bytes read from memory per GPU (for Model Flops "
                "Utilization calculations).",
            ),
            (
                "vllm:estimated_write_bytes_per_gpu_total",
                "Estimated number of bytes written to memory per GPU (for Model Flops "
                "Utilization calculations).",
            ),
        ):
            Counter(name, doc, labels, registry=r).labels(*self._lv)
        rejections = Counter(
            "vllm:admission_rejections",
            "Number of admission attempts rejected by a queue limit, by reason.",
            ["model_name", "reason"],
            registry=r,
        )
        for reason in ADMISSION_REASONS:
            rejections.labels(model_name, reason)
        self.preemptions = Counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            labels,
            registry=r,
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
            "Histogram of e2e request latency in seconds.",
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
        for reason in FINISH_REASONS:
            self._success.labels(*self._lv, reason)
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=r
        ).labels(*self._lv)
        by_source = Counter(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            [*labels, "source"],
            registry=r,
        )
        self.prompt_computed, self.prompt_local_hit, _ = (
            by_source.labels(*self._lv, s) for s in PROMPT_SOURCES
        )
        self.prompt_cached = Counter(
            "vllm:prompt_tokens_cached",
            "Number of cached prompt tokens (local + external).",
            labels,
            registry=r,
        ).labels(*self._lv)
        cached_by_source = Counter(
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), "
            "host (offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or "
            "external_unspecified. Counted at admission; sums to vllm:prefix_cache_hits + "
            "vllm:external_prefix_cache_hits.",
            [*labels, "source"],
            registry=r,
        )
        for source in CACHE_HIT_SOURCES:
            cached_by_source.labels(*self._lv, source)
        self.cached_device = cached_by_source.labels(*self._lv, "device")
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", labels, registry=r
        ).labels(*self._lv)
        self.iteration_tokens = Histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            labels,
            buckets=ITERATION_TOKENS_BUCKETS,
            registry=r,
        ).labels(*self._lv)
        self.max_generation_tokens = Histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            labels,
            buckets=token_buckets,
            registry=r,
        ).labels(*self._lv)
        self.params_n = Histogram(
            "vllm:request_params_n",
            "Histogram of the n request parameter.",
            labels,
            buckets=REQUEST_PARAMS_N_BUCKETS,
            registry=r,
        ).labels(*self._lv)
        self.params_max_tokens = Histogram(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            labels,
            buckets=token_buckets,
            registry=r,
        ).labels(*self._lv)
        self.request_preemptions = Histogram(
            "vllm:request_num_preemptions",
            "Histogram of the number of times a request was preempted.",
            labels,
            buckets=REQUEST_NUM_PREEMPTIONS_BUCKETS,
            registry=r,
        ).labels(*self._lv)
        self.prefill_kv_computed = Histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            labels,
            buckets=token_buckets,
            registry=r,
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

    def render(self, names: list[str]) -> bytes:
        """The exposition of the registry, restricted to the samples `names` when not empty,
        with vLLM's `_created` samples. Whether prometheus_client renders those is one
        process-wide flag read at collect time, which the gateway's metrics module turns off
        when imported (in-process tests hold both): set it for this render only. Nothing
        else renders meanwhile: this runs to its end on the event loop's thread."""
        reg = self.registry
        was = prom_metrics._use_created
        prom_metrics._use_created = CREATED
        try:
            return render_text(reg.restricted_registry(names) if names else reg)
        finally:
            prom_metrics._use_created = was

    def log_cache_config(self, info: dict[str, str]) -> None:
        """vllm:cache_config_info, set once at start as vLLM's log_engine_initialized: a gauge
        at 1 whose labels are the cache config's fields plus `engine` (no `model_name`)."""
        gauge = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            [*info, "engine"],
            registry=self.registry,
        )
        gauge.labels(*info.values(), self._lv[1]).set(1)

    def step(self, tokens: int, waiting: int, deferred: int) -> None:
        """Per engine step: its tokens (prompt tokens computed + tokens sampled, vLLM's
        iteration_tokens_total) and the waiting requests by reason (deferred: set aside for the
        LoRA budget)."""
        self.iteration_tokens.observe(tokens)
        self.waiting_capacity.set(waiting - deferred)
        self.waiting_deferred.set(deferred)

    def prefilled(self, prompt: int, cached: int) -> None:
        """A sequence's prompt done (its first token): prompt tokens by source, as vLLM counts
        them when a request leaves prefill."""
        self.prompt_computed.inc(prompt - cached)
        if cached:
            self.prompt_local_hit.inc(cached)
            self.prompt_cached.inc(cached)

    def request_done(self, n: int, max_generated: int) -> None:
        """A request (one prompt's n sequences) finished, as vLLM's parent request records it
        once its last child finishes: its `n` and the most tokens one of them generated."""
        self.params_n.observe(n)
        self.max_generation_tokens.observe(max_generated)

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
        self.request_preemptions.observe(f.preemptions)
        self.prefill_kv_computed.observe(f.prompt - f.cached)
        if f.max_tokens:
            self.params_max_tokens.observe(f.max_tokens)
        # Every finished sequence, 0 without a decode (vLLM's mean_time_per_output_token):
        # its count is e2e's.
        self.tpot.observe((f.last - f.first) / (f.generated - 1) if f.generated > 1 else 0.0)
