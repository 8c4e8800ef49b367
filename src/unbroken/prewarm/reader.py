"""Read files into the page cache as fast as the storage allows, without copying them.

Worker threads move each file, in fixed-size chunks, into the page cache with
`sendfile(2)` to /dev/null: the kernel reads the pages (its own readahead ahead of each
stream, widened by `POSIX_FADV_SEQUENTIAL`) and hands them to /dev/null by reference, so no
byte is copied to user space and the process holds no buffer at all. Measured on the 2-core
VM (2 GiB, evicted): 0.10-0.16 s of CPU against 0.5-2 s for the `preadv` copy it replaced,
which is what made the pre-warm lose to `dd` on a busy machine (issue 21, finding 7); under
a 300 MB/s cap at nice 10, a nice-0 event loop beside it woke up 2 ms late at p99 (4 ms at
worst) instead of 17 ms (83 ms). Where a filesystem cannot splice, the chunk is read with
`preadv` through a reusable 4 MiB buffer per worker (threads x 4 MiB of memory). There is no
`POSIX_FADV_WILLNEED` on whole files up front: it queued every file's I/O at once from the
calling thread, ahead of the ramp below, and was measured slower (docs/prewarm.md).

With no thread count given, the pool adapts: it starts with 2 workers and doubles while a
doubling still raises throughput by 25 % or more over a 0.5 s window (a single stream
saturates a VM disk; NVMe wants many), up to `max_threads`; the workers of a doubling that did
not pay are retired. On rate-capped storage (network storage, the demo's cgroup cap) more
readers add nothing but I/O queued at once: under a 300 MB/s cap, 8 readers (where an earlier
ramp, 0.2 s windows and 10 %, ended up on the cap's own burstiness) delayed a nice-0 event
loop's wake-ups by up to 38 ms on the idle VM, 1 reader by 8-11 ms, at the same 3.5 s per GiB.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["ReadStats", "warm_files"]

CHUNK = 16 * 2**20  # per sendfile call: progress granularity; no memory is held for it
COPY_BUFFER = 4 * 2**20  # per worker, only where a file cannot be spliced
RAMP_WINDOW_S = 0.5  # throughput is measured over this long per step of the ramp
RAMP_GAIN = 1.25  # a doubling of the readers is kept when it raised throughput this much
# sendfile errors that mean "this file cannot be spliced", not "this file cannot be read".
_NO_SPLICE = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}


@dataclass
class ReadStats:
    files: int
    bytes: int
    seconds: float
    threads: int
    thread_history: list[tuple[int, float]] = field(default_factory=list)  # (threads, GB/s)
    method: str = "sendfile"  # "sendfile", or "preadv" when a file could not be spliced

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
        self.copied = False  # some chunk had to be read with preadv
        self.drained = threading.Event()  # every chunk is taken (or a reader failed)

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
                self.drained.set()
                return None
            item = self.items[self.next]
            self.next += 1
            return item


def _send(null: int, fd: int, off: int, length: int) -> int:
    """Bring [off, off+length) into the page cache by splicing it to /dev/null; the bytes
    done. Raises OSError with an errno in _NO_SPLICE where the file cannot be spliced."""
    got = 0
    while got < length:
        n = os.sendfile(null, fd, off + got, length - got)
        if n == 0:  # end of file (it shrank meanwhile)
            break
        got += n
    return got


def _copy(view: memoryview, fd: int, off: int, length: int) -> int:
    """The fallback: read [off, off+length) through `view`, a buffer of any size."""
    got = 0
    while got < length:
        n = os.preadv(fd, [view[: min(len(view), length - got)]], off + got)
        if n == 0:
            break
        got += n
    return got


def warm_files(
    files: list[Path],
    *,
    threads: int | None = None,
    chunk: int = CHUNK,
    max_threads: int = 32,
    progress: Callable[[int], None] | None = None,
    splice: bool = True,
) -> ReadStats:
    """Read `files` into the page cache; `splice=False` forces the `preadv` copy (tests,
    benchmarks)."""
    fds: list[int] = []
    items: list[tuple[int, int, int]] = []
    no_splice: set[int] = set()  # fds that sendfile refused: read with preadv
    try:
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            fds.append(fd)
            size = os.fstat(fd).st_size
            os.posix_fadvise(fd, 0, size, os.POSIX_FADV_SEQUENTIAL)  # a wider readahead
            items += [(fd, off, min(chunk, size - off)) for off in range(0, size, chunk)]
            if not splice:
                no_splice.add(fd)
        null = os.open(os.devnull, os.O_WRONLY)
        fds.append(null)
        work = _Work(items)
        t0 = time.perf_counter()
        pool: list[threading.Thread] = []

        def worker() -> None:
            view: memoryview | None = None  # the preadv buffer, made only if needed
            try:
                while not work.retire() and (item := work.take()) is not None:
                    fd, off, length = item
                    got = -1
                    if fd not in no_splice:
                        try:
                            got = _send(null, fd, off, length)
                        except OSError as e:
                            if e.errno not in _NO_SPLICE:
                                raise
                            no_splice.add(fd)
                    if got < 0:
                        if view is None:
                            view = memoryview(bytearray(min(chunk, COPY_BUFFER)))
                        got = _copy(view, fd, off, length)
                        work.copied = True
                    with work.lock:
                        work.done_bytes += got
                    if progress is not None:
                        progress(got)
            except BaseException as e:  # surfaced to the caller below
                work.error = e
                work.drained.set()

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
            while work.target < max_threads:
                b0, s0 = work.done_bytes, time.perf_counter()
                # Not a plain sleep: that kept the command waiting out the window after
                # the last chunk (up to 0.5 s, a third of a 2 GiB read here).
                if work.drained.wait(RAMP_WINDOW_S):
                    break
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
            len(files),
            work.done_bytes,
            time.perf_counter() - t0,
            work.target,
            history,
            "preadv" if work.copied else "sendfile",
        )
    finally:
        for fd in fds:
            os.close(fd)
