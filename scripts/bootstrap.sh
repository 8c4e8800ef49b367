#!/usr/bin/env bash
# Set up a fresh machine for unbroken: system packages (when root), a virtualenv with the
# project and its dev tools, and the stand-in CUDA libraries. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
# chromium: the report's browser test; prometheus: promtool for the exporters' check;
# redis-server: the tenants' shared rate-limit store in tests (rate_limit.store: redis).
APT_PKGS=(gcc libc6-dev binutils util-linux vmtouch clang libbpf-dev bpftool bpftrace chromium prometheus redis-server)

need=()
if command -v dpkg-query >/dev/null 2>&1; then
  for p in "${APT_PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || need+=("$p")
  done
fi
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "bootstrap: installing ${need[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  else
    echo "bootstrap: missing system packages: ${need[*]} (install them as root)" >&2
  fi
fi

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for c in python3.11 python3.12 python3.13 python3; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
      PY=$c; break
    fi
  done
fi
[ -n "$PY" ] || { echo "bootstrap: Python >= 3.11 is required" >&2; exit 1; }

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -e '.[dev]'
"$VENV/bin/python" -m unbroken.engine.cuda >/dev/null
# Real vLLM for tests/vllm (its own venv, cached): installed by the tier's first test when
# missing; UNBROKEN_VLLM=1 installs it here instead (minutes, ~3.5 GB).
if [ "${UNBROKEN_VLLM:-0}" = 1 ]; then ./scripts/vllm-venv.sh >/dev/null; fi
echo "bootstrap: ready ($("$VENV/bin/python" --version), $VENV)"
