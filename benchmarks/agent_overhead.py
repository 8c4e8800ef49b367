"""What the agent's uprobes cost: calls per second of the stand-in `cuLaunchKernel`, without
the agent and with it attached, for three prologues (alternating passes, medians):

- push:          the default build (frame pointers, no CET), like libcudart's entry points;
- endbr64+push:  built with -fcf-protection=full; the agent attaches after the endbr64;
- other:         built so the entry point is a `mov` (tail call), not a push; the
                 agent refuses this one by default (single-stepped), measured here with
                 --allow-slow-probes to show why.

The caller is a small C loop (dlopen + dlsym), so the figures are the probe's, not Python's.
Needs root. `python benchmarks/agent_overhead.py [--calls 2000000] [--repeats 3]`
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _common import table
from unbroken.agent.build import build_objects
from unbroken.agent.cuda import CudaTracer
from unbroken.agent.elf import function_offsets, plan_probe
from unbroken.engine import cuda as stub

LOOP_C = r"""
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
typedef int (*launch_t)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                        unsigned, void *, void **, void **);
int main(int argc, char **argv) {
    void *h = dlopen(argv[1], RTLD_NOW);
    if (!h) { fprintf(stderr, "%s\n", dlerror()); return 1; }
    launch_t f = (launch_t)dlsym(h, "cuLaunchKernel");
    long n = atol(argv[2]);
    for (long i = 0; i < n / 10; i++) f(0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0);
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (long i = 0; i < n; i++) f(0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0);
    clock_gettime(CLOCK_MONOTONIC, &b);
    printf("%.3f\n", ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / n);
    return 0;
}
"""

VARIANTS = {
    "push": ["-fno-omit-frame-pointer", "-fcf-protection=none"],
    "endbr64+push": ["-fno-omit-frame-pointer", "-fcf-protection=full"],
    # No inlining and sibling calls: the entry point is `mov ...; jmp`, not a push.
    "other": [
        "-fomit-frame-pointer",
        "-fcf-protection=none",
        "-fno-inline",
        "-foptimize-sibling-calls",
    ],
}


def build(tmp: Path) -> tuple[Path, dict[str, Path]]:
    loop = tmp / "loop"
    (tmp / "loop.c").write_text(LOOP_C)
    subprocess.run(["cc", "-O2", "-o", str(loop), str(tmp / "loop.c"), "-ldl"], check=True)
    src = Path(stub.__file__).parent
    libs = {}
    for name, flags in VARIANTS.items():
        out = tmp / f"libubcuda-{name.replace('+', '_')}.so"
        subprocess.run(
            ["cc", "-O2", "-fPIC", "-shared", *flags, "-o", str(out), str(src / "ubcuda_driver.c")],
            check=True,
        )
        libs[name] = out
    return loop, libs


def per_call(loop: Path, lib: Path, calls: int) -> float:
    return float(
        subprocess.run(
            [str(loop), str(lib), str(calls)], capture_output=True, text=True, check=True
        ).stdout
    )


def floor_row(loop: Path, lib: Path, args: argparse.Namespace) -> list[str]:
    """The kernel's floor: an empty uprobe+uretprobe pair (bpftrace) on the push build."""
    base, traced = [], []
    for _ in range(args.repeats):
        base.append(per_call(loop, lib, args.calls))
        bt = subprocess.Popen(
            [
                "bpftrace",
                "-e",
                f"uprobe:{lib}:cuLaunchKernel {{ }} uretprobe:{lib}:cuLaunchKernel {{ }}",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert bt.stdout is not None
        bt.stdout.readline()  # "Attaching 2 probes..."
        time.sleep(1.0)
        traced.append(per_call(loop, lib, args.calls))
        bt.terminate()
        bt.wait(10)
    b, t = statistics.median(base), statistics.median(traced)
    return [
        "push (floor)",
        "empty pair, bpftrace",
        "-",
        f"{b:.1f}",
        f"{t:.1f}",
        f"{(t - b) / 1e3:.3f}",
        f"{t / b:.1f}x",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--calls", type=int, default=2_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root to load BPF programs")
    tmp = Path(tempfile.mkdtemp(prefix="ub-agent-bench-"))
    loop, libs = build(tmp)
    obj = build_objects()["cuda"]
    rows = []
    for name, lib in libs.items():
        off, code = function_offsets(lib, {"cuLaunchKernel"})["cuLaunchKernel"]
        probe = plan_probe("cuLaunchKernel", off, code)
        base, traced = [], []
        for _ in range(args.repeats):
            base.append(per_call(loop, lib, args.calls))
            tracer = CudaTracer(obj, allow_slow=True)
            try:
                tracer.attach_library(str(lib))
                n = args.calls if probe.cheap else max(10_000, args.calls // 50)
                traced.append(per_call(loop, lib, n))
            finally:
                tracer.close()
        b, t = statistics.median(base), statistics.median(traced)
        rows.append(
            [
                name,
                f"{probe.prologue} @ +{probe.offset - off}",
                "yes" if probe.cheap else "no (refused by default)",
                f"{b:.1f}",
                f"{t:.1f}",
                f"{(t - b) / 1e3:.3f}",
                f"{t / b:.1f}x",
            ]
        )
    if shutil.which("bpftrace"):
        rows.append(floor_row(loop, libs["push"], args))
    print(
        f"\nmachine: {platform.node()}, kernel {platform.release()}, {os.cpu_count()} cpus; "
        f"{args.calls:,} calls per pass, {args.repeats} passes, medians"
    )
    print(
        table(
            [
                "library build",
                "first instruction @ attach",
                "attached by default",
                "ns/call without",
                "ns/call with agent",
                "added µs/call",
                "ratio",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
