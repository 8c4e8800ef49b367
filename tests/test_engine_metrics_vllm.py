"""The simulator's /metrics against vLLM 0.32's, series for series: every `vllm:` family its API
server exports by default on one engine, with vLLM's type, labels and buckets, and values that
follow from the requests sent."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers import MODEL, Proc, engine, wait_for

# vLLM 0.32's default series, from vllm/v1/metrics/loggers.py (PrometheusStatLogger.__init__
# and log_metrics_info) and vllm/v1/metrics/perf.py (PerfMetricsProm, registered whatever
# --enable-mfu-metrics says): family name as exposed (prometheus_client drops a counter's
# `_total`), type, and the labels besides `model_name` and `engine`. Left out as vLLM leaves
# them out by default: spec_decode_* (no speculative config), kv_connector/ec_connector
# series (no kv_transfer_config), num_requests_kv_fetch_by_stage (not a KV consumer),
# kv_block_* (--kv-cache-metrics), corrupted_requests (VLLM_COMPUTE_NANS_IN_LOGITS),
# watermark_requests (watermark_config), lora_requests_info (--enable-lora).
EXPECTED: dict[str, tuple[str, tuple[str, ...]]] = {
    "vllm:num_requests_running": ("gauge", ()),
    "vllm:num_requests_waiting": ("gauge", ()),
    "vllm:num_requests_waiting_by_reason": ("gauge", ("reason",)),
    "vllm:engine_sleep_state": ("gauge", ("sleep_state",)),
    "vllm:kv_cache_usage_perc": ("gauge", ()),
    "vllm:prefix_cache_queries": ("counter", ()),
    "vllm:prefix_cache_hits": ("counter", ()),
    "vllm:external_prefix_cache_queries": ("counter", ()),
    "vllm:external_prefix_cache_hits": ("counter", ()),
    "vllm:mm_cache_queries": ("counter", ()),
    "vllm:mm_cache_hits": ("counter", ()),
    "vllm:num_preemptions": ("counter", ()),
    "vllm:prompt_tokens": ("counter", ()),
    "vllm:prompt_tokens_by_source": ("counter", ("source",)),
    "vllm:prompt_tokens_cached": ("counter", ()),
    "vllm:prompt_tokens_cached_by_source": ("counter", ("source",)),
    "vllm:generation_tokens": ("counter", ()),
    "vllm:request_success": ("counter", ("finished_reason",)),
    "vllm:admission_rejections": ("counter", ("reason",)),  # model_name only, no engine
    "vllm:request_prompt_tokens": ("histogram", ()),
    "vllm:request_generation_tokens": ("histogram", ()),
    "vllm:iteration_tokens_total": ("histogram", ()),
    "vllm:request_max_num_generation_tokens": ("histogram", ()),
    "vllm:request_params_n": ("histogram", ()),
    "vllm:request_params_max_tokens": ("histogram", ()),
    "vllm:time_to_first_token_seconds": ("histogram", ()),
    "vllm:inter_token_latency_seconds": ("histogram", ()),
    "vllm:request_time_per_output_token_seconds": ("histogram", ()),
    "vllm:e2e_request_latency_seconds": ("histogram", ()),
    "vllm:request_queue_time_seconds": ("histogram", ()),
    "vllm:request_inference_time_seconds": ("histogram", ()),
    "vllm:request_prefill_time_seconds": ("histogram", ()),
    "vllm:request_decode_time_seconds": ("histogram", ()),
    "vllm:request_num_preemptions": ("histogram", ()),
    "vllm:request_prefill_kv_computed_tokens": ("histogram", ()),
    "vllm:estimated_flops_per_gpu": ("counter", ()),
    "vllm:estimated_read_bytes_per_gpu": ("counter", ()),
    "vllm:estimated_write_bytes_per_gpu": ("counter", ()),
    "vllm:cache_config_info": ("gauge", ()),  # labels checked below
}

# vLLM's page (prometheus_client's default REGISTRY, `_created` samples left on) has one
# `<name>_created` sample per counter and histogram series, never for a gauge; the text
# format gives them families of their own, typed gauge.
CREATED = {f"{name}_created": name for name, (kind, _) in EXPECTED.items() if kind != "gauge"}

# Label values vLLM pre-creates (loggers.py; FinishReason, PromptTokenStats.ALL_SOURCES,
# CacheHitSource, ADMISSION_REASONS).
LABEL_VALUES = {
    "vllm:num_requests_waiting_by_reason": {"capacity", "deferred"},
    "vllm:engine_sleep_state": {"awake", "weights_offloaded", "discard_all"},
    "vllm:prompt_tokens_by_source": {"local_compute", "local_cache_hit", "external_kv_transfer"},
    "vllm:prompt_tokens_cached_by_source": {
        "device",
        "host",
        "p2p",
        "disk",
        "external_unspecified",
    },
    "vllm:request_success": {"stop", "length", "abort", "error", "repetition"},
    "vllm:admission_rejections": {"max_num_queued_reqs", "max_num_queued_tokens"},
}

# vllm/v1/metrics/buckets.py; the token-count ones are build_1_2_5_buckets(max_model_len).
TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0]
TTFT += [7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
ITL += [20.0, 40.0, 80.0]
LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0]
LATENCY += [120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
TOKENS_16K = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000]  # max_model_len 16,384
ITERATION = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
BUCKETS: dict[str, list[float]] = {
    "vllm:time_to_first_token_seconds": TTFT,
    "vllm:inter_token_latency_seconds": ITL,
    "vllm:request_time_per_output_token_seconds": ITL,
    "vllm:iteration_tokens_total": ITERATION,
    "vllm:request_params_n": [1, 2, 5, 10, 20],
    "vllm:request_num_preemptions": [1, 2, 3, 4, 5, 10, 20],
    **{
        f"vllm:request_{n}_time_seconds": LATENCY
        for n in ("queue", "inference", "prefill", "decode")
    },
    "vllm:e2e_request_latency_seconds": LATENCY,
    **{
        name: TOKENS_16K
        for name in (
            "vllm:request_prompt_tokens",
            "vllm:request_generation_tokens",
            "vllm:request_max_num_generation_tokens",
            "vllm:request_params_max_tokens",
            "vllm:request_prefill_kv_computed_tokens",
        )
    },
}

# vLLM 0.32's CacheConfig().metrics_info() keys (vllm/config/cache.py, read from an instance).
CACHE_CONFIG_KEYS = {
    "block_size", "user_specified_block_size", "kv_cache_layout", "prefix_match_unit",
    "gpu_memory_utilization", "cache_dtype", "is_attention_free", "num_gpu_blocks_override",
    "sliding_window", "enable_prefix_caching", "prefix_caching_hash_algo",
    "prefix_cache_retention_interval", "kv_cache_dtype_skip_layers", "mamba_page_size_padded",
    "skip_page_size_padded", "mamba_block_size", "mamba_cache_dtype", "mamba_ssm_cache_dtype",
    "mamba_cache_mode", "enable_mamba_shared_prefix_checkpoint", "replayssm_buffer_len",
    "use_replayssm", "use_kda_recoverssm", "num_gpu_blocks", "num_cpu_blocks",
    "effective_attention_block_size", "kv_cache_size_tokens", "kv_cache_max_concurrency",
    "hash_block_size", "cache_hit_alignment_tokens", "kv_sharing_fast_prefill",
    "swa_bounded_replay", "kv_cache_memory_bytes", "kv_offloading_size", "kv_offloading_backend",
    "_block_size_resolved",
}  # fmt: skip


class Scrape:
    """One /metrics, parsed: families by name and sample values by (name, labels)."""

    def __init__(self, url: str) -> None:
        text = httpx.get(url + "/metrics", timeout=5).text
        self.families = {f.name: f for f in text_string_to_metric_families(text)}

    def samples(self, family: str, suffix: str = "") -> list[Any]:
        return [s for s in self.families[family].samples if s.name == family + suffix]

    def value(self, family: str, suffix: str = "", **labels: str) -> float:
        found = [
            s.value
            for s in self.samples(family, suffix)
            if all(s.labels.get(k) == v for k, v in labels.items())
        ]
        assert len(found) == 1, (family, suffix, labels, found)
        return found[0]


def _post(p: Proc, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(p.url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def eng(logdir: Path) -> Iterator[Proc]:
    """Its own engine, so the counters start at zero; blocks of 4 tokens so that the n
    siblings of a prompt hit the prefix cache."""
    p = engine(logdir, "--block-size", "4", name="vllm-metrics")
    yield p
    p.stop()


PROMPT = "The history of the printing press begins with movable type in East Asia and"


def test_every_default_vllm_series_with_vllm_types_labels_and_buckets(eng: Proc) -> None:
    m = Scrape(eng.url)
    ours = {n for n in m.families if n.startswith("vllm:")}
    want = set(EXPECTED) | set(CREATED)
    assert ours == want, f"missing: {sorted(want - ours)}; extra: {sorted(ours - want)}"
    now = time.time()
    for name, base in CREATED.items():
        fam = m.families[name]
        assert fam.type == "gauge", (name, fam.type)
        series = {tuple(sorted(s.labels.items())) for s in m.samples(name)}
        assert series == {
            tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
            for s in m.families[base].samples
        }, name
        # When each series was created: at the engine's start, before this scrape.
        assert all(now - 600 < s.value <= now for s in m.samples(name)), name
    for name, (kind, extra) in EXPECTED.items():
        fam = m.families[name]
        assert fam.type == kind, (name, fam.type)
        assert fam.documentation, name
        base = {"model_name"} if name == "vllm:admission_rejections" else {"model_name", "engine"}
        if name == "vllm:cache_config_info":
            base = {"engine"} | CACHE_CONFIG_KEYS
        assert fam.samples, name
        for s in fam.samples:
            assert set(s.labels) - {"le"} == base | set(extra), (name, s.labels)
            assert s.labels["model_name" if "model_name" in base else "engine"] in (MODEL, "0")
        if name in LABEL_VALUES:
            (label,) = extra
            assert {s.labels[label] for s in fam.samples} == LABEL_VALUES[name], name
        if kind == "histogram":
            les = [float(s.labels["le"]) for s in m.samples(name, "_bucket")]
            assert les == [float(b) for b in BUCKETS[name]] + [float("inf")], name
    info = m.samples("vllm:cache_config_info")
    assert len(info) == 1 and info[0].value == 1
    lab = info[0].labels
    assert (lab["engine"], lab["block_size"], lab["enable_prefix_caching"]) == ("0", "4", "True")
    assert int(lab["num_gpu_blocks"]) * 4 == int(lab["kv_cache_size_tokens"]) > 0
    sleep = {s.labels["sleep_state"]: s.value for s in m.samples("vllm:engine_sleep_state")}
    assert sleep == {"awake": 1, "weights_offloaded": 0, "discard_all": 0}


def test_values_follow_from_the_requests(eng: Proc) -> None:
    before = Scrape(eng.url)
    assert before.value("vllm:iteration_tokens_total", "_count") == 0
    # Parent requests (vLLM's unit for n and the most tokens generated) and sequences:
    # 1 prompt x n=3 (max_tokens 5), a chat (max_tokens 9), 2 prompts x n=2 (max_tokens 4).
    r1 = _post(eng, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "n": 3})
    r2 = _post(
        eng,
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 9},
    )
    r3 = _post(
        eng,
        "/v1/completions",
        {"model": MODEL, "prompt": ["Once upon a time", "In a hole"], "max_tokens": 4, "n": 2},
    )
    generated = sum(r["usage"]["completion_tokens"] for r in (r1, r2, r3))
    assert generated == 3 * 5 + 9 + 4 * 4  # no EOS (eos-rate 0): every choice runs to length
    # usage counts each prompt once whatever n (vLLM); the counter every sequence's prompt.
    prompt = sum(r["usage"]["prompt_tokens"] * n for r, n in ((r1, 3), (r2, 1), (r3, 2)))
    m = Scrape(eng.url)

    # request_params_n: one observation per prompt (a parent request), its n.
    assert m.value("vllm:request_params_n", "_count") == 4
    assert m.value("vllm:request_params_n", "_sum") == 3 + 1 + 2 + 2
    n_le = {s.labels["le"]: s.value for s in m.samples("vllm:request_params_n", "_bucket")}
    assert (n_le["1.0"], n_le["2.0"], n_le["5.0"]) == (1, 3, 4)
    # request_params_max_tokens: one per sequence (vLLM: per finished child request).
    assert m.value("vllm:request_params_max_tokens", "_count") == 8
    assert m.value("vllm:request_params_max_tokens", "_sum") == 3 * 5 + 9 + 4 * 4
    # request_max_num_generation_tokens: per parent, the most one of its n generated.
    assert m.value("vllm:request_max_num_generation_tokens", "_count") == 4
    assert m.value("vllm:request_max_num_generation_tokens", "_sum") == 5 + 9 + 4 + 4

    # Prompt tokens: the counter counts every sequence's prompt; those computed and those
    # found in the prefix cache add up to it, and the cache did serve the n=3 siblings.
    assert m.value("vllm:prompt_tokens", "_total") == prompt
    computed = m.value("vllm:prompt_tokens_by_source", "_total", source="local_compute")
    hit = m.value("vllm:prompt_tokens_by_source", "_total", source="local_cache_hit")
    assert hit > 0 and computed + hit == prompt
    assert m.value("vllm:prompt_tokens_by_source", "_total", source="external_kv_transfer") == 0
    assert m.value("vllm:prompt_tokens_cached", "_total") == hit
    assert m.value("vllm:prefix_cache_hits", "_total") == hit
    assert m.value("vllm:prompt_tokens_cached_by_source", "_total", source="device") == hit
    assert m.value("vllm:request_prefill_kv_computed_tokens", "_count") == 8
    assert m.value("vllm:request_prefill_kv_computed_tokens", "_sum") == computed

    # iteration_tokens_total: every step's computed prompt tokens plus sampled tokens.
    assert m.value("vllm:generation_tokens", "_total") == generated
    steps = m.value("vllm:iteration_tokens_total", "_count")
    assert 0 < steps <= generated
    assert m.value("vllm:iteration_tokens_total", "_sum") == computed + generated

    assert m.value("vllm:request_num_preemptions", "_count") == 8
    assert m.value("vllm:request_num_preemptions", "_sum") == 0
    assert m.value("vllm:request_success", "_total", finished_reason="length") == 8
    # Idle now: nothing waits, for any reason.
    assert m.value("vllm:num_requests_waiting") == 0
    for reason in ("capacity", "deferred"):
        assert m.value("vllm:num_requests_waiting_by_reason", reason=reason) == 0


def test_time_per_output_token_is_observed_for_every_finished_request(eng: Proc) -> None:
    """vLLM observes request_time_per_output_token_seconds for every finished request, 0
    for one without a decode (one token): its count is e2e's."""
    before = Scrape(eng.url)
    tpot = "vllm:request_time_per_output_token_seconds"
    zero = before.value(tpot, "_bucket", le="0.01")
    for max_tokens in (1, 1, 6):
        _post(eng, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens})
    m = Scrape(eng.url)
    e2e = m.value("vllm:e2e_request_latency_seconds", "_count")
    assert e2e == before.value("vllm:e2e_request_latency_seconds", "_count") + 3
    assert m.value(tpot, "_count") == e2e
    assert m.value(tpot, "_count") - before.value(tpot, "_count") == 3
    # The two one-token requests observed 0 (the first bucket, le=0.01).
    assert m.value(tpot, "_bucket", le="0.01") - zero >= 2


def test_preemptions_per_request(logdir: Path) -> None:
    """A KV cache of 16 blocks of 4 tokens for 4 sequences of ~36 tokens: the newest are
    preempted, and each finished request's count adds up to the engine's counter."""
    p = engine(
        logdir, "--block-size", "4", "--kv-capacity-tokens", "64", name="vllm-metrics-preempt"
    )
    try:
        errors: list[str] = []

        def one(i: int) -> None:
            r = httpx.post(
                p.url + "/v1/completions",
                json={"model": MODEL, "prompt": f"Story {i} of", "max_tokens": 30},
                timeout=60,
            )
            if r.status_code != 200:
                errors.append(r.text)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        m = Scrape(p.url)
        total = m.value("vllm:num_preemptions", "_total")
        assert total > 0
        assert m.value("vllm:request_num_preemptions", "_count") == 4
        assert m.value("vllm:request_num_preemptions", "_sum") == total
    finally:
        p.stop()


def test_waiting_by_reason_sums_to_waiting_and_counts_lora_deferrals(logdir: Path) -> None:
    """With --max-loras 1, a request for a second adapter waits for the LoRA budget
    ('deferred') while one for the running adapter holds it."""
    lora = ("--enable-lora", "--lora-modules", "a1=/lora/a1", "a2=/lora/a2", "--max-loras", "1")
    p = engine(logdir, *lora, name="vllm-metrics-lora")
    try:
        seen: list[tuple[float, float, float]] = []

        def send(model: str) -> None:
            httpx.post(
                p.url + "/v1/completions",
                json={"model": model, "prompt": "Hello", "max_tokens": 60},
                timeout=60,
            )

        threads = [threading.Thread(target=send, args=(m,)) for m in ("a1", "a2", "a2")]
        for t in threads:
            t.start()

        def deferred() -> bool:
            m = Scrape(p.url)
            w = m.value("vllm:num_requests_waiting")
            cap = m.value("vllm:num_requests_waiting_by_reason", reason="capacity")
            dfr = m.value("vllm:num_requests_waiting_by_reason", reason="deferred")
            seen.append((w, cap, dfr))
            return dfr > 0

        wait_for(deferred, timeout=20)
        for t in threads:
            t.join()
        # The gauges are set one after the other by the step loop; a scrape between two
        # sets may disagree, so most (not all) scrapes must add up.
        adds_up = [w == cap + dfr for w, cap, dfr in seen]
        assert sum(adds_up) >= len(adds_up) / 2, seen
        assert Scrape(p.url).value("vllm:num_requests_waiting_by_reason", reason="deferred") == 0
    finally:
        p.stop()


def test_name_filter_renders_only_the_named_samples(eng: Proc) -> None:
    """`/metrics?name[]=...` as prometheus_client's exposition (vLLM's /metrics) answers it:
    only the named samples (a histogram's `_sum` without its buckets), and the controller's
    and the prober's restricted pages read the same values as the whole page."""
    from unbroken.controller.signals import _ENGINE_LINES, ENGINE_METRICS_PATH, parse_text
    from unbroken.gateway._prober import METRICS_PATH, parse_load

    _post(eng, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 3})
    names = ["vllm:num_requests_running", "vllm:time_to_first_token_seconds_sum"]
    r = httpx.get(eng.url + "/metrics", params=[("name[]", n) for n in names], timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    got = {
        s.name for f in text_string_to_metric_families(r.text) for s in f.samples
    }  # fmt: skip
    assert got == set(names), got
    full = httpx.get(eng.url + "/metrics", timeout=10).text
    for path in (ENGINE_METRICS_PATH, METRICS_PATH):
        part = httpx.get(eng.url + path, timeout=10).text
        assert 0 < len(part) < len(full) / 10, (path, len(part), len(full))
        # The prober's page carries the generated-token count too (its sign of progress).
        n = 4 if path == METRICS_PATH else 3
        assert parse_load(part)[:n] == parse_load(full)[:n]
    assert parse_load(httpx.get(eng.url + METRICS_PATH, timeout=10).text)[3] >= 3
    part = httpx.get(eng.url + ENGINE_METRICS_PATH, timeout=10).text

    def lines(text: str) -> set[tuple[str, float]]:
        return {
            (s.name, s.value) for s in parse_text(text, _ENGINE_LINES) if s.name in _ENGINE_LINES
        }

    read = lines(part)
    assert read == lines(full)
    assert dict(read)["vllm:time_to_first_token_seconds_count"] >= 1, read


def test_created_samples_whatever_turned_them_off_in_the_process() -> None:
    """The gateway's metrics module turns prometheus_client's `_created` samples off for the
    whole process when imported; the engine's page has them all the same, and leaves the
    process's setting as it found it."""
    import prometheus_client.metrics as prom_metrics

    import unbroken.gateway._metrics  # noqa: F401  (turns them off)
    from unbroken.engine.metrics import EngineMetrics

    assert prom_metrics._use_created is False
    m = EngineMetrics(MODEL)
    text = m.render([]).decode()
    fams = {f.name for f in text_string_to_metric_families(text)}
    assert set(CREATED) <= fams, sorted(set(CREATED) - fams)
    part = m.render(["vllm:prompt_tokens_created"]).decode()
    assert [s.name for f in text_string_to_metric_families(part) for s in f.samples] == [
        "vllm:prompt_tokens_created"
    ]
    assert prom_metrics._use_created is False


def test_classic_text_whatever_the_scraper_asks(eng: Proc) -> None:
    """vLLM 0.32's GET /metrics (prometheus-fastapi-instrumentator's route) answers the classic
    text, uncompressed, to a scraper that asks for OpenMetrics and gzip: so does the simulator,
    so Prometheus ingests the same series (`_created` ones included) from both."""
    headers = {
        "Accept": "application/openmetrics-text;version=1.0.0,text/plain;q=0.5",
        "Accept-Encoding": "gzip",
    }
    r = httpx.get(eng.url + "/metrics", headers=headers, timeout=10)
    assert r.status_code == 200 and "content-encoding" not in r.headers
    assert r.headers["content-type"].startswith("text/plain")
    assert "# EOF" not in r.text and "# TYPE vllm:prompt_tokens_total counter" in r.text
