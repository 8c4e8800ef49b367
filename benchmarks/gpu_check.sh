#!/usr/bin/env bash
# Prepared GPU check for the eBPF agent (issue: agent on real CUDA libraries).
# Run on a machine with an NVIDIA GPU, root, a kernel with BTF, python3 and torch:
#   bash benchmarks/gpu_check.sh            # results in ${OUT:-./gpu-check-out}
# Records: the real libcuda/libcudart prologues and where the agent attaches, exact call
# counts and latency histograms for a PyTorch loop (kernels, allocations, copies, a graph).
# BPF objects are built with clang+bpftool when present; else set UNBROKEN_BPF_OBJ_DIR to
# objects built elsewhere (python -c 'from unbroken.agent.build import build_objects as b;
# print(b())' on a machine that has them; CO-RE objects run on any kernel with BTF).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./gpu-check-out}
mkdir -p "$OUT"
{
  echo "date: $(date -u +%FT%TZ)"; echo "kernel: $(uname -r)"; echo "euid: $(id -u)"
  echo "btf: $([ -e /sys/kernel/btf/vmlinux ] && echo yes || echo no)"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -2
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1
  command -v clang bpftool bpftrace 2>&1
} | tee "$OUT/env.txt"
timeout 300 python3 benchmarks/gpu_agent_probe.py > "$OUT/gpu_check.json" 2> "$OUT/gpu_check.err"
rc=$?
echo "probe exit code: $rc" | tee -a "$OUT/env.txt"
tail -5 "$OUT/gpu_check.err"
python3 - "$OUT/gpu_check.json" <<'PY' 2>/dev/null || true
import json, sys
d = json.load(open(sys.argv[1]))
print(d["device"], "torch", d["torch"], "cuda", d["cuda"])
for lib, a in d["attached"].items():
    print(lib)
    for p in a["attached"]:
        print(f"  attached {p['function']:<24} {p['prologue']:<16} +{p['offset']:#x}")
    for p in a["skipped"]:
        print(f"  SKIPPED  {p['function']:<24} {p['prologue']:<16} (single-step)")
for fn, c in d["calls"].items():
    print(f"{fn:<24} {c['count']:>8} calls  mean {c['mean_us']:.2f} us")
PY
exit $rc
