"""Admission state shared by the gateway's worker processes (docs/gateway.md, "Process model").

One file mapped by every process holds two tables of int64:

    inflight[row, col]   slots worker `row` holds on endpoint `col`
    depth[row, prio]     requests worker `row` has queued, per priority
    conns[row]           client connections worker `row` has open (its accepts' balance)
    listening[row]       1 while worker `row` accepts on the shared socket
    busy[row]            worker `row`'s CPU, per mille of a core, over its last ~0.5 s
    seen[row]            when `busy` was written (CLOCK_MONOTONIC, ms): a hung worker's is old
    served[row, col]     legs worker `row` admitted to endpoint `col`, ever (the admin API's
                         `served`; kept when a worker goes, cleared when a column is reused)

A process writes only its own row, so giving slots back needs no lock; an endpoint's load is
the sum of its column. Taking slots is check-then-add, so it runs under one POSIX record lock
(`lockf`), held for a few microseconds, which the kernel releases if its holder dies. When a
worker dies the main process zeroes its row: the slots of its streams come back at once.
Rows are handed out by the main process (a reload's new workers take free rows while the old
ones drain); columns are endpoints, assigned by the main process by name.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

__all__ = ["MAX_ENDPOINTS", "MAX_WORKERS", "SharedCounters", "SharedSlot"]

MAX_WORKERS = 64  # rows: serving workers plus old ones still draining after reloads
MAX_ENDPOINTS = 1024  # columns
_PRIOS = 3
_STALE_MS = 2000  # a worker whose `busy` is older than this is not packed onto


class SharedCounters:
    def __init__(self, path: Path, *, create: bool = False, row: int = -1) -> None:
        self.path = path
        self.row = row
        size = 8 * MAX_WORKERS * (2 * MAX_ENDPOINTS + _PRIOS + 4)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        self._fd = os.open(path, flags, 0o600)
        if create:
            os.ftruncate(self._fd, size)
        # A main process of an older version (before `conns`, 2026-12-05, or `busy`,
        # 2026-12-06) made a shorter file and keeps it across a reload: its new workers map
        # what is there, without balance (or without packing).
        size = min(size, os.fstat(self._fd).st_size)
        self._map = mmap.mmap(self._fd, size)
        flat = np.frombuffer(self._map, dtype=np.int64)
        self.inflight = flat[: MAX_WORKERS * MAX_ENDPOINTS].reshape(MAX_WORKERS, MAX_ENDPOINTS)
        at = MAX_WORKERS * MAX_ENDPOINTS
        self.depth = flat[at : at + MAX_WORKERS * _PRIOS].reshape(MAX_WORKERS, _PRIOS)
        at += MAX_WORKERS * _PRIOS
        self.balanced = len(flat) >= at + 2 * MAX_WORKERS
        self.conns = flat[at : at + MAX_WORKERS]  # empty in an older file
        self.listening = flat[at + MAX_WORKERS : at + 2 * MAX_WORKERS]
        self.packs = len(flat) >= at + 4 * MAX_WORKERS
        self.busy = flat[at + 2 * MAX_WORKERS : at + 3 * MAX_WORKERS]
        self.seen = flat[at + 3 * MAX_WORKERS : at + 4 * MAX_WORKERS]
        at += 4 * MAX_WORKERS
        self.served = (  # None in an older main process's file (before 2026-12-07)
            flat[at : at + MAX_WORKERS * MAX_ENDPOINTS].reshape(MAX_WORKERS, MAX_ENDPOINTS)
            if len(flat) >= at + MAX_WORKERS * MAX_ENDPOINTS
            else None
        )

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        fcntl.lockf(self._fd, fcntl.LOCK_EX, 1, 0)
        try:
            yield
        finally:
            fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, 0)

    def total(self, col: int) -> int:
        return int(self.inflight[:, col].sum())

    def add(self, col: int, n: int) -> None:
        self.inflight[self.row, col] += n

    def serve(self, col: int) -> None:
        if self.served is not None:
            self.served[self.row, col] += 1

    def served_total(self, col: int) -> int:
        return 0 if self.served is None else int(self.served[:, col].sum())

    def clear_col(self, col: int) -> None:
        """A column given to another endpoint: its served count starts again (its in-flight
        count is already 0: a column is reused only then)."""
        if self.served is not None:
            self.served[:, col] = 0

    def queued(self, prio: int) -> int:
        """Requests of priority `prio` waiting in all workers."""
        return int(self.depth[:, prio].sum())

    def set_depth(self, prio: int, n: int) -> None:
        self.depth[self.row, prio] = n

    def set_conns(self, n: int, listening: bool) -> None:
        if self.balanced:
            self.conns[self.row] = n
            self.listening[self.row] = int(listening)

    def fewest_conns_elsewhere(self) -> int | None:
        """The fewest client connections any other accepting worker has; None when none (or
        in an older main process's file, which has no counts)."""
        if not self.balanced:
            return None
        others = [int(self.conns[r]) for r in np.flatnonzero(self.listening) if r != self.row]
        return min(others) if others else None

    def set_busy(self, permille: int) -> None:
        if self.packs:
            self.busy[self.row] = permille
            self.seen[self.row] = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1_000_000

    def packer(self, max_busy: int, max_conns: int) -> int | None:
        """The row that takes new connections while workers pack: the lowest-numbered
        accepting worker whose CPU (published in the last `_STALE_MS`) is under `max_busy`
        per mille and whose connections are under `max_conns`. None when none is (or in an
        older table): then connections spread by count."""
        if not self.packs:
            return None
        now = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1_000_000
        for r in np.flatnonzero(self.listening):
            if (
                self.busy[r] < max_busy
                and self.conns[r] < max_conns
                and now - self.seen[r] < _STALE_MS
            ):
                return int(r)
        return None

    def clear_row(self, row: int) -> None:
        """A worker is gone: what it held is free again."""
        self.inflight[row, :] = 0
        self.depth[row, :] = 0
        if self.balanced:
            self.conns[row] = 0
            self.listening[row] = 0
        if self.packs:
            self.busy[row] = 0
            self.seen[row] = 0

    def close(self) -> None:
        # The numpy views hold the buffer; drop them before the map.
        del self.inflight, self.depth, self.conns, self.listening, self.busy, self.seen
        del self.served
        with contextlib.suppress(BufferError):
            self._map.close()
        os.close(self._fd)


class SharedSlot:
    """An endpoint's in-flight count in the shared table (see `Endpoint.slot`)."""

    __slots__ = ("col", "shared")

    def __init__(self, shared: SharedCounters, col: int) -> None:
        self.shared = shared
        self.col = col

    def get(self) -> int:
        return self.shared.total(self.col)

    def add(self, n: int) -> None:
        self.shared.add(self.col, n)

    def serve(self) -> None:
        self.shared.serve(self.col)

    def served(self) -> int:
        return self.shared.served_total(self.col)
