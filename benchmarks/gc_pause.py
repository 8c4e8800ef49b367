"""What a full garbage collection costs in each long-running process, with its start-up heap
as CPython leaves it and after `freeze_startup_heap()` (src/unbroken/wire/heap.py).

Each row is a fresh interpreter that imports what that process imports and builds what it
builds before it serves (the engine's app and text model, a gateway worker's app, the
controller, the demo's load generator), then times `gc.collect()` (a full, generation-2
collection: the pause every stream of that process sees when one runs) `--repeats` times,
first as is, then after the freeze, in the same process. Medians; the ratio is
frozen / as is. `python benchmarks/gc_pause.py [--repeats 7]`
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _common import median, table

SETUPS = {
    "engine": (
        "from unbroken.engine.server import Engine, EngineConfig\n"
        "e = Engine(EngineConfig())\n"
        "app = e.app()\n"
    ),
    "gateway worker": (
        "from unbroken.gateway._worker import WorkerGateway\n"
        "from unbroken.gateway._server import Gateway\n"
        "from unbroken.config.spec import GatewaySettings\n"
        "import unbroken.gateway._admin, unbroken.gateway._proxy\n"
    ),
    "controller": "import unbroken.controller.service\n",
    "load generator (demo)": (
        "import unbroken.bench.demo, unbroken.bench.passes, unbroken.bench.load\n"
        "import unbroken.pipeline.supervisor\n"
    ),
}

PROBE = """
import gc, json, time
{setup}
def timed(n):
    out = []
    for _ in range(n):
        t = time.perf_counter(); gc.collect(); out.append(time.perf_counter() - t)
    return out
before = timed({n})
tracked = len(gc.get_objects())
from unbroken.wire.heap import freeze_startup_heap
freeze_startup_heap()
after = timed({n})
print(json.dumps({{"before": before, "after": after, "tracked": tracked,
                  "frozen": gc.get_freeze_count()}}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    rows = []
    for name, setup in SETUPS.items():
        code = PROBE.format(setup=setup, n=args.repeats)
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"{name}: {r.stderr.strip().splitlines()[-1]}")
        d = json.loads(r.stdout.strip().splitlines()[-1])
        b, a = median(d["before"]) * 1e3, median(d["after"]) * 1e3
        rows.append(
            [name, f"{d['tracked']:,}", f"{b:.2f} ms", f"{a * 1e3:.1f} us", f"{a / b:.4f}x"]
        )
    headers = ["process", "tracked objects", "full collection", "after freeze", "ratio"]
    print(table(headers, rows))


if __name__ == "__main__":
    main()
