"""The tenants' bucket levels and open streams in shared memory (`TenantTable`): the local
half of the per-tenant limits (`_ratelimit.py` says what the limits are and how a request is
checked against them).

One file for all workers of a gateway, next to the admission table (anonymous memory for a
single process): per tenant slot the three buckets (level used, time last written) and, per
worker row, the streams it has open. Check-then-take runs under one `lockf` lock
(microseconds); a dead worker's row is zeroed by the main process, so its streams' slots come
back. Apart from `_ratelimit` because it is the storage layout (sizes, offsets, the lock),
which the main process also uses to hand out slots and clear rows, without the limiter.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

__all__ = ["KINDS", "LIMIT_KEYS", "MAX_TENANTS", "TenantTable"]

MAX_TENANTS = 1024
_ROWS = 64  # as many as the admission table's (MAX_WORKERS)
KINDS = ("requests", "prompt_tokens", "completion_tokens")
LIMIT_KEYS = ("requests_per_minute", "prompt_tokens_per_minute", "completion_tokens_per_minute")


class TenantTable:
    """The levels of every tenant's buckets and its open streams (module doc). One file
    shared by the workers (`path`), or anonymous memory for a single process."""

    def __init__(self, path: Path | None = None, *, create: bool = False, row: int = 0) -> None:
        self.path = path
        self.row = row
        n_b = MAX_TENANTS * len(KINDS) * 2
        n_s = _ROWS * MAX_TENANTS
        size = 8 * (n_b + n_s + 8)
        self._fd = -1
        if path is None:
            self._map = mmap.mmap(-1, size)
        else:
            flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
            self._fd = os.open(path, flags, 0o600)
            if create:
                os.ftruncate(self._fd, size)
            self._map = mmap.mmap(self._fd, size)
        flat = np.frombuffer(self._map, dtype=np.float64)
        self.buckets = flat[:n_b].reshape(MAX_TENANTS, len(KINDS), 2)
        ints = np.frombuffer(self._map, dtype=np.int64)
        self.streams = ints[n_b : n_b + n_s].reshape(_ROWS, MAX_TENANTS)
        self.flags = ints[n_b + n_s :]  # [0]: the shared store is down (1) or not (0)

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        if self._fd < 0:
            yield
            return
        fcntl.lockf(self._fd, fcntl.LOCK_EX, 1, 0)
        try:
            yield
        finally:
            fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, 0)

    def level(self, slot: int, kind: int, limit: float, now: float) -> float:
        lvl, t = self.buckets[slot, kind]
        return max(0.0, float(lvl) - max(0.0, now - float(t)) * limit / 60.0)

    def add(self, slot: int, kind: int, n: float, limit: float, now: float) -> None:
        b = self.buckets[slot, kind]
        b[0] = self.level(slot, kind, limit, now) + n
        b[1] = now

    def open_streams(self, slot: int) -> int:
        return int(self.streams[:, slot].sum())

    def clear_row(self, row: int) -> None:
        """A worker is gone: its open streams are no longer open."""
        self.streams[row, :] = 0

    def clear_slot(self, slot: int) -> None:
        """A slot given to a tenant new to this gateway starts empty."""
        self.buckets[slot] = 0.0
        self.streams[:, slot] = 0

    def close(self) -> None:
        del self.buckets, self.streams, self.flags
        with contextlib.suppress(BufferError):
            self._map.close()
        if self._fd >= 0:
            os.close(self._fd)
