# Two commands on a fresh machine: `make demo` (set up, then run the main job) and `make test`.
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.bootstrapped

.PHONY: setup demo up test lint bench clean

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
