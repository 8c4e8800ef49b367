"""Cold start: how fast weights reach the page cache, and what that does to engine start.

One run, on generated safetensors weights (4 GiB by default, less if memory is short). Each
measurement starts from an evicted cache and they alternate across repeats (medians reported):

- limit: raw parallel O_DIRECT reads, the best of several thread counts and request sizes
  (no page cache): what the disk gives;
- dd bs=1M (serial, file by file), cat, vmtouch -t, and unbroken prewarm (adaptive threads);
- engine start (process start to /health 200) with a cold cache, right after a prewarm, and
  with no weights at all: the floor no loader can go below (interpreter, imports, server).

With `--storage-mbps N` (root) the whole run reads through a cgroup block-I/O cap of N MB/s
on the weights' disk (`unbroken.bench.throttle`): the seed's network storage is about 300.
`--starts-only` skips the read-method table.

    python benchmarks/coldstart.py [--size 4GiB] [--repeats 3] [--dir PATH]
        [--storage-mbps 300] [--starts-only]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


from _common import table
from unbroken.bench.coldstart import engine_start as start_engine
from unbroken.bench.throttle import IoThrottle
from unbroken.engine.weights import make_weights, parse_size
from unbroken.prewarm import evict, find_weight_files, memory_available, warm_files
from unbroken.wire.http import free_port

CHUNK = 4 * 2**20


def o_direct_read(files: list[Path], threads: int = 8, chunk: int = CHUNK) -> None:
    items = [(f, off) for f in files for off in range(0, f.stat().st_size, chunk)]
    lock = threading.Lock()

    def worker() -> None:
        buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT requires
        fds: dict[Path, int] = {}
        try:
            while True:
                with lock:
                    if not items:
                        return
                    f, off = items.pop()
                fd = fds.get(f)
                if fd is None:
                    fd = fds[f] = os.open(f, os.O_RDONLY | os.O_DIRECT)
                os.preadv(fd, [buf], off)
        finally:
            for fd in fds.values():
                os.close(fd)
            buf.close()

    ts = [threading.Thread(target=worker) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def run(cmd: list[str]) -> None:
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def engine_start(weights: Path | None) -> tuple[float, float]:
    port = free_port()
    argv = [sys.executable, "-m", "unbroken", "engine", "--port", str(port)]
    if weights is not None:
        argv += ["--weights", str(weights)]
    return asyncio.run(start_engine(argv, f"http://127.0.0.1:{port}"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size", default="4GiB")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--dir", type=Path, default=Path.home() / ".cache" / "unbroken" / "bench-weights"
    )
    ap.add_argument("--storage-mbps", type=float, default=0.0, help="read cap (root); 0: none")
    ap.add_argument("--starts-only", action="store_true", help="engine starts only")
    args = ap.parse_args()
    size = parse_size(args.size)
    room, source = memory_available()
    if size > room // 3:
        size = (room // 3) // 2**20 * 2**20
        print(
            f"memory: {room / 1e9:.1f} GB available ({source}); using {size / 2**30:.2f} GiB",
            file=sys.stderr,
        )
    d = args.dir / f"{size}"
    if not (d / ".complete").exists():
        print(f"generating {size / 2**30:.2f} GiB of weights in {d}", file=sys.stderr)
        make_weights(d, size)
        (d / ".complete").write_text("ok")
    files = find_weight_files([str(d)])
    total = sum(f.stat().st_size for f in files)
    throttle = None
    if args.storage_mbps > 0:
        throttle = IoThrottle.create(d, int(args.storage_mbps * 1e6))
        print(f"storage: {throttle.describe()}", file=sys.stderr)
    try:
        if throttle is not None:
            throttle.add(os.getpid())  # this process and what it starts; remove() moves it out
        measure(args, d, files, total)
    finally:
        if throttle is not None:
            throttle.remove()


def measure(args: argparse.Namespace, d: Path, files: list[Path], total: int) -> None:
    fl = [str(f) for f in files]
    # The limit: the best of several O_DIRECT queue depths and request sizes (no page cache).
    limits = {(8, CHUNK), (16, 16 * 2**20), (32, 8 * 2**20), (64, CHUNK)}
    methods = {
        **{
            f"O_DIRECT {t}x{c >> 20}M": (lambda t=t, c=c: o_direct_read(files, t, c))
            for t, c in sorted(limits)
        },
        "dd bs=1M": lambda: [run(["dd", f"if={f}", "of=/dev/null", "bs=1M"]) for f in fl],
        "cat": lambda: run(["sh", "-c", 'cat "$@" > /dev/null', "cat", *fl]),
        "unbroken prewarm": lambda: warm_files(files),
    }
    if args.starts_only:
        methods = {"unbroken prewarm": methods["unbroken prewarm"]}
    elif shutil.which("vmtouch"):
        methods["vmtouch -t"] = lambda: run(["vmtouch", "-t", "-q", *fl])
    else:
        print("vmtouch not installed (apt-get install vmtouch): skipped", file=sys.stderr)
    times: dict[str, list[float]] = {m: [] for m in methods}
    starts: dict[str, list[tuple[float, float]]] = {"cold": [], "prewarmed": [], "floor": []}
    prewarm_s: list[float] = []
    for rep in range(args.repeats):
        order = list(methods) if rep % 2 == 0 else list(reversed(methods))
        for name in order:
            for f in files:
                evict(f)
            t0 = time.perf_counter()
            methods[name]()
            times[name].append(time.perf_counter() - t0)
            print(
                f"  rep {rep + 1} {name:<22} {total / times[name][-1] / 1e9:6.2f} GB/s",
                file=sys.stderr,
            )
        for f in files:
            evict(f)
        starts["cold"].append(engine_start(d))
        for f in files:
            evict(f)
        prewarm_s.append(warm_files(files).seconds)
        starts["prewarmed"].append(engine_start(d))
        starts["floor"].append(engine_start(None))
        print(
            f"  rep {rep + 1} engine start cold {starts['cold'][-1][0]:.2f} s, "
            f"prewarmed {starts['prewarmed'][-1][0]:.2f} s, "
            f"no weights {starts['floor'][-1][0]:.2f} s",
            file=sys.stderr,
        )
    med = {m: statistics.median(v) for m, v in times.items()}
    limit = min((s for m, s in med.items() if m.startswith("O_DIRECT")), default=math.nan)
    rows = [
        [m, f"{total / s / 1e9:.2f}", f"{s:.2f}", "-" if math.isnan(limit) else f"{limit / s:.2f}"]
        for m, s in med.items()
    ]
    print(
        f"\nmachine: {platform.node()}, {os.cpu_count()} cpus, kernel {platform.release()}; "
        f"{len(files)} files, {total / 2**30:.2f} GiB; {args.repeats} repeats, medians; "
        + (f"reads capped at {args.storage_mbps:g} MB/s" if args.storage_mbps > 0 else "bare disk")
    )
    print(table(["method", "GB/s", "seconds", "ratio to limit"], rows))
    cold = statistics.median(s for s, _ in starts["cold"])
    warm = statistics.median(s for s, _ in starts["prewarmed"])
    floor = statistics.median(s for s, _ in starts["floor"])
    cold_l = statistics.median(w for _, w in starts["cold"])
    warm_l = statistics.median(w for _, w in starts["prewarmed"])
    print()
    print(
        table(
            ["engine start", "to /health s", "weight load s", "speed-up"],
            [
                ["cold page cache", f"{cold:.2f}", f"{cold_l:.2f}", "1.00x"],
                ["after unbroken prewarm", f"{warm:.2f}", f"{warm_l:.2f}", f"{cold / warm:.2f}x"],
                ["(the pre-warm itself)", f"{statistics.median(prewarm_s):.2f}", "-", "-"],
                ["no weights (floor)", f"{floor:.2f}", "-", f"{cold / floor:.2f}x"],
            ],
        )
    )
    print(
        f"\nthe most any loader could give here: {cold / floor:.2f}x "
        f"(cold start over the start with no weights at all)"
    )


if __name__ == "__main__":
    main()
