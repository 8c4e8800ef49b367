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

`--tools` (issue 21, finding 7) measures instead the `unbroken prewarm` command against
`dd bs=1M`, `cat` and `vmtouch -t` (and the reader's `preadv` copy path), each as a process
of its own, on 2 GiB (`--tools-size`) of fresh random shards in a temporary directory beside
`--dir` (so on the same disk), evicted and checked non-resident before every run, tools
alternating order, `--repeats` runs each: wall time median [min-max], ratio to dd, CPU time
of the tool and its children, the residency after the run, and how late a nice-0 asyncio
loop in this process (sleeping 20 ms) woke up meanwhile. First on the bare disk (tools at
nice 0), then, with `--storage-mbps N`, through the cap at nice 10 as the demo runs it.

    python benchmarks/coldstart.py [--size 4GiB] [--repeats 3] [--dir PATH]
        [--storage-mbps 300] [--starts-only]
    python benchmarks/coldstart.py --tools [--tools-size 2GiB] [--repeats 3] [--storage-mbps 300]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


from _common import table
from unbroken.bench.coldstart import engine_start as start_engine
from unbroken.bench.throttle import IoThrottle
from unbroken.engine.weights import make_weights, parse_size
from unbroken.prewarm import evict, find_weight_files, memory_available, residency, warm_files
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
    ap.add_argument("--tools", action="store_true", help="prewarm against dd, cat, vmtouch")
    ap.add_argument("--tools-size", default="2GiB")
    args = ap.parse_args()
    if args.tools:
        tools_main(args)
        return
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


# --- --tools: the pre-warm command against dd, cat and vmtouch (issue 21, finding 7) ---

TOOLS_SHARDS = 4
LOOP_SLEEP_S = 0.02
# wall s, CPU s, loop p99/max ms, % resident, the read's own s (NaN: not reported)
Run = tuple[float, float, float, float, float, float]


def tools_main(args: argparse.Namespace) -> None:
    size = parse_size(args.tools_size)
    args.dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="coldstart-tools-", dir=args.dir.parent) as tmp:
        d = Path(tmp)
        print(f"generating {size / 2**30:.2f} GiB in {TOOLS_SHARDS} shards in {d}", file=sys.stderr)
        make_weights(d, size, shard_bytes=-(-size // TOOLS_SHARDS))
        files = find_weight_files([str(d)])
        total = sum(f.stat().st_size for f in files)
        cmds = _tool_commands(files)
        print(
            f"\nmachine: {platform.node()}, {os.cpu_count()} cpus, kernel {platform.release()}, "
            f"load {os.getloadavg()[0]:.1f}; {len(files)} files, {total / 2**30:.2f} GiB, "
            f"evicted before each run; {args.repeats} runs per tool, alternating; "
            f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC"
        )
        print("\nbare disk (tools at nice 0)")
        quiet = _idle_lateness()
        print(_tools_table(_tools_runs(cmds, files, args.repeats, nice=0), total))
        print(quiet)
        if args.storage_mbps > 0:
            throttle = IoThrottle.create(d, int(args.storage_mbps * 1e6))
            try:
                throttle.add(os.getpid())  # what it starts inherits the cap
                quiet = _idle_lateness()
                runs = _tools_runs(cmds, files, args.repeats, nice=10)
            finally:
                throttle.remove()
            print(f"\n{throttle.describe()} (tools at nice 10, as the demo runs the pre-warm)")
            print(_tools_table(runs, total))
            print(quiet)
        print(f"\nload average after: {os.getloadavg()[0]:.1f}")


def _tool_commands(files: list[Path]) -> dict[str, list[str]]:
    fl = [str(f) for f in files]
    py = sys.executable
    copy = (
        "import sys; from pathlib import Path; from unbroken.prewarm import warm_files; "
        "warm_files([Path(a) for a in sys.argv[1:]], splice=False)"
    )
    cmds = {
        "dd bs=1M": ["sh", "-c", 'for f; do dd if="$f" of=/dev/null bs=1M 2>/dev/null; done', "dd"],
        "cat": ["sh", "-c", 'cat "$@" > /dev/null', "cat"],
        "unbroken prewarm": [py, "-m", "unbroken", "prewarm", "--json"],
        "prewarm, preadv copy": [py, "-c", copy],
    }
    if shutil.which("vmtouch"):
        cmds["vmtouch -t"] = ["vmtouch", "-t", "-q"]
    else:
        print("vmtouch not installed (scripts/bootstrap.sh installs it): skipped", file=sys.stderr)
    return {name: [*argv, *fl] for name, argv in cmds.items()}


class _Neighbour:
    """A nice-0 asyncio loop in a thread of this process, sleeping 20 ms at a time: how late
    it wakes up while a tool runs is what the reads cost a neighbouring event loop."""

    def __init__(self) -> None:
        self.late: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._loop()), daemon=True)

    async def _loop(self) -> None:
        while not self._stop.is_set():
            t = time.perf_counter()
            await asyncio.sleep(LOOP_SLEEP_S)
            self.late.append(time.perf_counter() - t - LOOP_SLEEP_S)

    def __enter__(self) -> _Neighbour:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _idle_lateness(seconds: float = 3.0) -> str:
    """The loop's lateness with no tool running: what the rest of the machine costs it."""
    _, _, p99, worst, _ = _timed(["sleep", str(seconds)], 0)
    return f"(loop late with no tool running, {seconds:g} s: p99 {p99:.1f} / max {worst:.1f} ms)"


def _resident_pages(files: list[Path]) -> tuple[int, int]:
    rs = [residency(f) for f in files]
    return sum(r.resident_pages for r in rs), sum(r.pages for r in rs)


def _evicted(files: list[Path]) -> None:
    for _ in range(3):
        for f in files:
            evict(f)
        resident, pages = _resident_pages(files)
        if resident <= pages // 1000:
            return
    raise RuntimeError(f"eviction failed: {resident} of {pages} pages still resident")


def _timed(argv: list[str], nice: int) -> tuple[float, float, float, float, float]:
    """(wall s, CPU s of the process and its children, loop lateness p99 and max in ms, and
    the read's own seconds where the tool reports them (`--json`), else NaN)."""
    preexec: Callable[[], object] | None = (lambda: os.nice(nice)) if nice else None
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, _Neighbour() as loop:
        t0 = time.perf_counter()
        p = subprocess.Popen(argv, stdout=out, stderr=err, preexec_fn=preexec)
        _, status, ru = os.wait4(p.pid, 0)  # the rusage counts the children it waited for
        wall = time.perf_counter() - t0
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if p.returncode != 0:
            msg = err.read().decode(errors="replace").strip()[-300:]
            raise RuntimeError(f"{argv[:4]} exited {p.returncode}: {msg}")
        read_s = json.loads(out.read())["read"]["seconds"] if "--json" in argv else math.nan
    late = sorted(loop.late) or [0.0]
    p99 = late[min(len(late) - 1, int(0.99 * len(late)))]
    return wall, ru.ru_utime + ru.ru_stime, p99 * 1e3, late[-1] * 1e3, read_s


def _tools_runs(
    cmds: dict[str, list[str]], files: list[Path], repeats: int, nice: int
) -> dict[str, list[Run]]:
    runs: dict[str, list[Run]] = {n: [] for n in cmds}
    for rep in range(max(1, repeats)):
        order = list(cmds) if rep % 2 == 0 else list(reversed(cmds))
        for name in order:
            _evicted(files)
            wall, cpu, p99, worst, read_s = _timed(cmds[name], nice)
            resident, pages = _resident_pages(files)
            runs[name].append((wall, cpu, p99, worst, 100.0 * resident / pages, read_s))
            print(f"  rep {rep + 1} {name:<22} {wall:6.2f} s  {cpu:5.2f} s CPU", file=sys.stderr)
    return runs


def _tools_table(runs: dict[str, list[Run]], total: int) -> str:
    dd = statistics.median(r[0] for r in runs["dd bs=1M"])
    rows = []
    for name, rs in runs.items():
        walls = sorted(r[0] for r in rs)
        wall = statistics.median(walls)
        rows.append(
            [
                name,
                f"{wall:.2f} [{walls[0]:.2f}-{walls[-1]:.2f}]",
                f"{total / wall / 1e9:.2f}",
                f"{dd / wall:.2f}x",
                f"{statistics.median(r[1] for r in rs):.2f}",
                f"{statistics.median(r[2] for r in rs):.1f} / {max(r[3] for r in rs):.1f}",
                f"{min(r[4] for r in rs):.1f}",
            ]
        )
    headers = ["tool", "seconds", "GB/s", "vs dd", "CPU s", "loop late p99/max ms", "resident %"]
    reads = sorted(r[5] for r in runs["unbroken prewarm"])
    return (
        table(headers, rows)
        + f"\n(unbroken prewarm's read alone: {statistics.median(reads):.2f} s "
        + f"[{reads[0]:.2f}-{reads[-1]:.2f}]; the rest of the command's time is the CLI's "
        + "start and the residency check)"
    )


if __name__ == "__main__":
    main()
