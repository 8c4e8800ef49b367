#!/usr/bin/env bash
# Install the peer that `make bench` measures the gateway against: vLLM's Rust router
# (`vllm-router` from PyPI, https://github.com/vllm-project/router) in its own virtualenv, so
# that its pinned dependencies never meet the project's. Cached per version under
# ~/.cache/unbroken (override with UNBROKEN_BENCH_PEER_VENV); safe to run again: a finished
# venv is reused at once. Prints the router's executable as its last line. Fails (exit 1) with
# a message when it cannot install (no registry access, no wheel for this platform/Python).
set -euo pipefail

VERSION=${UNBROKEN_VLLM_ROUTER_VERSION:-0.1.17}
VENV=${UNBROKEN_BENCH_PEER_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/unbroken/vllm-router-venv-$VERSION}
STAMP="$VENV/.unbroken-ready"
EXE="$VENV/bin/vllm-router"

if [ -f "$STAMP" ] && [ -x "$EXE" ]; then echo "$EXE"; exit 0; fi

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for c in python3.11 python3.12 python3; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(sys.version_info < (3, 9))'; then
      PY=$c; break
    fi
  done
fi
[ -n "$PY" ] || { echo "bench-peer: Python >= 3.9 is required to install vllm-router" >&2; exit 1; }

mkdir -p "$(dirname "$VENV")"
# One installer at a time per venv (two benchmarks started together).
exec 9>"$VENV.lock"
flock 9
if [ -f "$STAMP" ] && [ -x "$EXE" ]; then echo "$EXE"; exit 0; fi

rm -rf "$VENV"
if ! "$PY" -m venv "$VENV" >&2; then
  echo "bench-peer: '$PY -m venv' failed (is the venv module installed?)" >&2
  exit 1
fi
echo "bench-peer: installing vllm-router==$VERSION into $VENV (~25 MB wheel)" >&2
if ! "$VENV/bin/python" -m pip install -q --disable-pip-version-check "vllm-router==$VERSION" >&2; then
  echo "bench-peer: pip could not install vllm-router==$VERSION (no registry access, or no" \
       "wheel for this platform: PyPI has manylinux wheels for x86_64)" >&2
  rm -rf "$VENV"
  exit 1
fi
if ! "$EXE" --help >/dev/null 2>&1; then
  echo "bench-peer: vllm-router installed but '$EXE --help' fails (its Rust extension does not" \
       "load here?)" >&2
  rm -rf "$VENV"
  exit 1
fi
touch "$STAMP"
echo "$EXE"
