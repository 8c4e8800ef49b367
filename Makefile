# Two commands on a fresh machine: `make demo` (set up, then run the main job) and `make test`.
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.bootstrapped

.PHONY: setup demo up test test-fast lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/bootstrap.sh
	VENV=$(VENV) ./scripts/bootstrap.sh
	touch $(STAMP)

demo: setup
	$(BIN)/unbroken demo

up: setup
	$(BIN)/unbroken up

test: setup
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/python -m pytest

# The tier a developer runs after each change (under 3 minutes here): in-process tests and
# tests of one process or one engine, no pipelines, no real vLLM. `make test` runs these too.
FAST_TESTS := $(addprefix tests/,test_sse.py test_relay_events.py test_layers.py test_metrics_filter.py \
	test_wire_http.py test_textmodel.py test_upstream.py test_cuda_stub.py \
	test_metrics_agent.py test_reliability_demo.py test_bench_priority.py test_engine_leak.py \
	test_k8s_render.py test_engine_prefix_cache.py test_hardening_prewarm.py \
	test_engine_api.py test_weights.py test_metrics_exporters.py test_report.py \
	test_prewarm.py test_routing_prefix.py test_gateway_tokens.py test_migration_fields.py \
	test_gateway_compat.py test_reliability_stream.py test_engine_runtime.py \
	test_bench_verify.py test_malformed.py test_bench_workloads.py test_spec_render.py \
	test_gateway_layers.py test_gateway_messages.py test_routing_adapters.py \
	test_engine_lora.py test_k8s_autoscale.py test_cpucap.py test_fairness.py \
	test_engine_metrics_vllm.py test_engine_responses.py test_engine_structured.py \
	test_engine_kv_events.py test_engine_messages.py test_engine_tokenize.py)

test-fast: setup
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/python -m pytest --reruns 0 $(FAST_TESTS)

lint: setup
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

# Gateway overhead against direct, then routing on prefix-heavy workloads, each with
# vllm-router (scripts/bench-peer.sh installs it into its own cached venv) as a peer;
# BENCH_ARGS="--no-peer" skips it, e.g. offline.
bench: setup
	$(BIN)/python benchmarks/gateway_overhead.py $(BENCH_ARGS)
	$(BIN)/python benchmarks/routing.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
