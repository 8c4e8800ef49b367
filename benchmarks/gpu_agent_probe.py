"""On a GPU machine: trace a real PyTorch CUDA workload with the agent's uprobes and record
the real libcuda/libcudart prologues, attach points, call counts and latencies.

Imports only the agent's stdlib-only modules (libbpf via ctypes, the ELF reader, the tracer),
so it runs under an image's own python3 with torch and nothing else. BPF objects: built here
with clang/bpftool if present, else taken from UNBROKEN_BPF_OBJ_DIR (built elsewhere: CO-RE
objects run on any kernel with BTF). Run through benchmarks/gpu_check.sh.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

os.environ.setdefault("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")  # every allocation: cudaMalloc


def objects() -> dict[str, Path]:
    pre = os.environ.get("UNBROKEN_BPF_OBJ_DIR")
    if pre:
        return {p: Path(pre) / f"{p}.bpf.o" for p in ("cuda", "tcp")}
    from unbroken.agent.build import build_objects

    return build_objects()


def libraries() -> list[str]:
    found = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1] if "/" in line else ""
        name = os.path.basename(path)
        if (name.startswith("libcuda.so") or name.startswith("libcudart.so")) and path not in found:
            found.append(path)
    return found


def main() -> None:
    import torch

    from unbroken.agent.cuda import CudaTracer
    from unbroken.agent.elf import function_offsets, plan_probe
    from unbroken.agent.functions import FUNCTIONS

    out: dict = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0),
    }
    torch.zeros(1, device="cuda")  # initialise: maps libcuda and libcudart
    libs = libraries()
    out["libraries"] = {}
    for lib in libs:
        offs = function_offsets(Path(lib), set(FUNCTIONS))
        out["libraries"][lib] = {
            n: {"offset": o, "first_bytes": code[:8].hex(), **vars(plan_probe(n, o, code))}
            for n, (o, code) in sorted(offs.items())
        }
    tracer = CudaTracer(objects()["cuda"], allow_slow=False)
    for lib in libs:
        tracer.attach_library(lib)
    out["attached"] = {
        r.path: {
            "attached": [vars(p) for p in r.attached],
            "skipped": [vars(p) for p in r.skipped],
            "error": r.error,
        }
        for r in tracer.libraries.values()
    }

    # The workload: launches, allocations, copies, a CUDA graph.
    plan = {"matmul": 2000, "alloc": 200, "h2d": 200, "graph_replays": 500}
    a = torch.randn(1024, 1024, device="cuda")
    b = torch.randn(1024, 1024, device="cuda")
    host = torch.randn(1 << 20).pin_memory()
    t0 = time.perf_counter()
    for _ in range(plan["matmul"]):
        a = torch.mm(a, b).tanh_()
    for _ in range(plan["alloc"]):
        torch.empty(1 << 20, device="cuda")
    for _ in range(plan["h2d"]):
        host.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            c = torch.mm(a, b)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        c = torch.mm(a, b)
    for _ in range(plan["graph_replays"]):
        g.replay()
    torch.cuda.synchronize()
    out["workload_s"] = time.perf_counter() - t0
    out["plan"] = plan
    stats = tracer.read()
    pid = os.getpid()
    out["calls"] = {
        fn: {
            "count": st.count,
            "mean_us": st.sum_ns / max(st.count, 1) / 1e3,
            "slots": {str(i): n for i, n in enumerate(st.slots) if n},
        }
        for (p, fn), st in sorted(stats.items())
        if p == pid
    }
    tracer.close()
    del c
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
