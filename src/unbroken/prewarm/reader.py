"""Read files into the page cache as fast as the storage allows, in bounded memory.

`posix_fadvise(WILLNEED)` starts the kernel's readahead on every file at once; worker threads
then read fixed-size chunks with `preadv` (which releases the GIL) into their own reusable
buffer, so memory held is threads x chunk size whatever the files' size. With no thread count
given, the pool adapts: it starts with 2 workers and doubles while a doubling still raises
throughput by 25 % or more over a 0.5 s window (a single stream saturates a VM disk; NVMe
wants many), up to `max_threads`; the workers of a doubling that did not pay are retired.
On rate-capped storage (network storage, the demo's cgroup cap) more readers add nothing but
I/O queued at once: under a 300 MB/s cap, 8 readers (where the earlier ramp, 0.2 s windows and
10 %, ended up on the cap's own burstiness) delayed a nice-0 event loop's wake-ups by up to
38 ms on the idle VM, 1 reader by 8-11 ms, at the same 3.5 s for 1 GiB.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["ReadStats", "warm_files"]

CHUNK = 4 * 2**20
RAMP_WINDOW_S = 0.5  # throughput is measured over this long per step of the ramp
RAMP_GAIN = 1.25  # a doubling of the readers is kept when it raised throughput this much


@dataclass
class ReadStats:
    files: int
    bytes: int
    seconds: float
    threads: int
    thread_history: list[tuple[int, float]] = field(default_factory=list)  # (threads, GB/s)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class _Work:
    def __init__(self, items: list[tuple[int, int, int]]) -> None:
        self.items = items
        self.next = 0
        self.lock = threading.Lock()
        self.done_bytes = 0
        self.error: BaseException | None = None
        self.active = 0  # worker threads running
        self.target = 0  # ... and how many should: the extra ones exit after their chunk

    def retire(self) -> bool:
        """Whether the calling worker should exit now (the pool is above its target)."""
        with self.lock:
            if self.active > self.target:
                self.active -= 1
                return True
            return False

    def take(self) -> tuple[int, int, int] | None:
        with self.lock:
            if self.next >= len(self.items) or self.error is not None:
                return None
            item = self.items[self.next]
            self.next += 1
            return item


def warm_files(
    files: list[Path],
    *,
    threads: int | None = None,
    chunk: int = CHUNK,
    max_threads: int = 32,
    progress: Callable[[int], None] | None = None,
) -> ReadStats:
    fds: list[int] = []
    items: list[tuple[int, int, int]] = []
    total = 0
    try:
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            fds.append(fd)
            size = os.fstat(fd).st_size
            os.posix_fadvise(fd, 0, size, os.POSIX_FADV_WILLNEED)
            os.posix_fadvise(fd, 0, size, os.POSIX_FADV_SEQUENTIAL)
            items += [(fd, off, min(chunk, size - off)) for off in range(0, size, chunk)]
            total += size
        work = _Work(items)
        t0 = time.perf_counter()
        pool: list[threading.Thread] = []

        def worker() -> None:
            buf = bytearray(chunk)
            view = memoryview(buf)
            try:
                while not work.retire() and (item := work.take()) is not None:
                    fd, off, length = item
                    got = 0
                    while got < length:
                        n = os.preadv(fd, [view[got:length]], off + got)
                        if n == 0:
                            break
                        got += n
                    with work.lock:
                        work.done_bytes += got
                    if progress is not None:
                        progress(got)
            except BaseException as e:  # surfaced to the caller below
                work.error = e

        def grow(n: int) -> None:
            with work.lock:
                work.active += n
                work.target += n
            for _ in range(n):
                t = threading.Thread(target=worker, daemon=True, name="prewarm")
                t.start()
                pool.append(t)

        history: list[tuple[int, float]] = []
        if threads is not None:
            grow(max(1, threads))
        else:
            grow(2)
            last_rate = 0.0
            while work.target < max_threads and any(t.is_alive() for t in pool):
                b0, s0 = work.done_bytes, time.perf_counter()
                time.sleep(RAMP_WINDOW_S)
                rate = (work.done_bytes - b0) / (time.perf_counter() - s0)
                history.append((work.target, rate / 1e9))
                if work.next >= len(items):
                    break
                if last_rate and rate < last_rate * RAMP_GAIN:
                    with work.lock:  # the last doubling did not pay: back to what did
                        work.target //= 2
                    break
                last_rate = rate
                grow(work.target)
        for t in pool:
            t.join()
        if work.error is not None:
            raise work.error
        return ReadStats(
            len(files), work.done_bytes, time.perf_counter() - t0, work.target, history
        )
    finally:
        for fd in fds:
            os.close(fd)
