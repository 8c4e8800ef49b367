"""The slots each tenant holds per pool and priority, shared by the gateway's workers, and the
reserve rule of fair queueing (issue 25; `_admission` applies it).

Fair queueing orders waiters, but a pool that an over-share tenant has filled still makes
another tenant's request wait for a slot to free: with equal-length streams started
together, the greedy tenant's slots free in bursts a stream's length apart. The reserve:
a tenant over its weighted share of a pool does not take the pool's last free slot(s) while
another tenant of the same priority is active there (held a slot or asked for one within
RESERVE_WINDOW_S) and under its share. The under-share tenant's next request then finds a
slot at once. It is work-conserving otherwise: with one active tenant, or none under its
share, every slot may be taken; and the slots kept back are at most one per under-share
tenant (and at most max(1, capacity // 16) per pool, none in a pool of fewer than 4 slots),
for as long as one of them stays active.

A tenant's share of a pool is the pool's capacity (its ready endpoints' caps) times its
weight over the weights of the tenants active there at that priority.

Layout (one file beside the admission table, mapped by every worker, or anonymous memory for
a single process): a flow is (priority, tenant, pool), registered once by name (a hash) under
the admission lock, so every worker finds the same index; per flow its weight and when it was
last active (CLOCK_MONOTONIC, the same in every process); and `held[row, flow]`, the slots
worker `row` holds for it, written only by that worker. A worker clears its row when it
starts (a row is reused after a death); a dead worker's row is also cleared once the main
process has cleared its admission row (it holds no slot, so it can hold no tenant's slot).

Fair queueing's turns across workers (`_admission`'s module doc) live here too, after `held`
(a worker of an older layout maps only the part before them): per priority the virtual
time; per (priority, tenant) "tag flow" its next start tag and `queued[row, flow]`, the
waiters worker `row` has queued for it; and per (priority, pool) "low group"
`low[row, group]`, the lowest start tag worker `row` has waiting there, plus one (0: none).
A worker writes only its rows (virtual time and next tags under the admission lock). A row
counts only while the worker publishes waiters of that priority in the admission table
(`SharedCounters.depth`), which it does before it counts a waiter here and after it
uncounts one, and which the main process zeroes when the worker dies: a dead worker's
waiters and tags never hold anyone up, and a flow idle in every live worker starts again at
the class's virtual time. Tag flows and low groups are registered like flows (names in
their own space, a group of their own that the reserve never reads).
"""

from __future__ import annotations

import hashlib
import mmap
import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from unbroken.gateway._shared import MAX_WORKERS

if TYPE_CHECKING:
    from unbroken.gateway._shared import SharedCounters

__all__ = ["RESERVE_WINDOW_S", "FairShare"]

# How long a tenant counts as active in a pool after it last held or asked for a slot there.
RESERVE_WINDOW_S = 5.0
# At most capacity // RESERVE_DIV slots of a pool are kept back (at least one).
RESERVE_DIV = 16
RESERVE_MIN_CAP = 4  # smaller pools keep nothing back
MAX_FLOWS = 1024  # (priority, tenant, pool) triples; beyond, a tenant gets no reserve
SWEEP_S = 1.0  # how often dead workers' rows are looked for (only while tenants contend)
_HDR = 8
_PRIOS = 4  # virtual times kept (three priorities, padded)


def reserve_cap(cap: int) -> int:
    """The most slots a pool of `cap` keeps back: max(1, cap // RESERVE_DIV), and none below
    RESERVE_MIN_CAP (one slot would be a third of the pool or more, kept idle for a window)."""
    return max(1, cap // RESERVE_DIV) if cap >= RESERVE_MIN_CAP else 0


def _hash(*parts: str) -> int:
    h = hashlib.blake2b("\0".join(parts).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little", signed=True) | 1  # never 0 (a free entry)


_AUX = _hash("\0aux")


class FairShare:
    def __init__(self, shared: SharedCounters | None = None) -> None:
        self.shared = shared
        # Made on a worker's first tenant request (never in a main process, which has no row).
        assert shared is None or shared.row >= 0
        self.row = 0 if shared is None else shared.row
        rows = MAX_WORKERS if shared is not None else 1
        size = 8 * (_HDR + 4 * MAX_FLOWS + rows * MAX_FLOWS)  # the reserve's (older) part
        size += 8 * (_PRIOS + MAX_FLOWS + 2 * rows * MAX_FLOWS)  # fair queueing's turns
        if shared is None:
            self._map = mmap.mmap(-1, size)
        else:
            path = Path(str(shared.path) + ".fair")
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                if os.fstat(fd).st_size < size:
                    os.ftruncate(fd, size)  # the same size in every worker: never shrinks
                self._map = mmap.mmap(fd, size)
            finally:
                os.close(fd)
        ints = np.frombuffer(self._map, dtype=np.int64)
        floats = np.frombuffer(self._map, dtype=np.float64)
        self.hdr = ints[:_HDR]  # [0]: flows registered
        o = _HDR
        self.keys = ints[o : o + MAX_FLOWS]
        self.groups = ints[o + MAX_FLOWS : o + 2 * MAX_FLOWS]
        self.weight = floats[o + 2 * MAX_FLOWS : o + 3 * MAX_FLOWS]
        self.seen = floats[o + 3 * MAX_FLOWS : o + 4 * MAX_FLOWS]
        o += 4 * MAX_FLOWS
        self.held = ints[o : o + rows * MAX_FLOWS].reshape(rows, MAX_FLOWS)
        o += rows * MAX_FLOWS
        self._vt0 = o  # per priority: the class's virtual time
        self._next0 = o + _PRIOS  # per tag flow: its next start tag
        o += _PRIOS + MAX_FLOWS
        self.queued = ints[o : o + rows * MAX_FLOWS].reshape(rows, MAX_FLOWS)
        self._queued0 = o + self.row * MAX_FLOWS
        o += rows * MAX_FLOWS
        self.low = floats[o : o + rows * MAX_FLOWS].reshape(rows, MAX_FLOWS)
        self._low0 = o + self.row * MAX_FLOWS
        # A row reused after a worker died.
        self.held[self.row, :] = 0
        self.queued[self.row, :] = 0
        self.low[self.row, :] = 0.0
        o = _HDR
        # The per-request reads and writes, through memoryviews (a numpy scalar access costs
        # several times as much): int64 and float64 views of the same map, and offsets.
        self._q = memoryview(self._map).cast("q")
        self._d = memoryview(self._map).cast("d")
        self._weight0 = o + 2 * MAX_FLOWS
        self._seen0 = o + 3 * MAX_FLOWS
        self._rows = rows
        self._row0 = o + 4 * MAX_FLOWS + self.row * MAX_FLOWS
        self._weights: dict[int, float] = {}  # what this process last wrote per flow
        self._index: dict[tuple[int, str, str], int] = {}  # this process's flows, by name
        self._aux: dict[tuple[str, int, str], int] = {}  # its tag flows and low groups
        self._group_of: list[int] = []  # per flow index known here: its group's hash
        self._members: dict[int, list[int]] = {}  # group hash -> its flows
        self._swept = 0.0

    def flow(self, rank: int, tenant: str, pool: str, weight: float) -> int | None:
        """The index of (priority, tenant, pool), registered on first use (the caller holds
        the admission lock when shared); None when the table is full."""
        key = (rank, tenant, pool)
        i = self._index.get(key)
        if i is None:
            i = self._register(_hash(str(rank), tenant, pool), _hash(str(rank), pool))
            if i is None:
                return None
            self._index[key] = i
        if self._weights.get(i) != weight:  # new here, or a reload changed it
            self._weights[i] = weight
            self.weight[i] = weight
        return i

    def _register(self, h: int, group: int, add: bool = True) -> int | None:
        """The index of the entry named `h`, added (in `group`) if `add` and new (the caller
        holds the admission lock when shared); None when absent or the table is full."""
        self._refresh()
        found = np.flatnonzero(self.keys[: len(self._group_of)] == h)
        if found.size:
            return int(found[0])
        n = int(self.hdr[0])
        if not add or n >= MAX_FLOWS:
            return None
        self.keys[n] = h
        self.groups[n] = group
        self.hdr[0] = n + 1
        self._refresh()
        return n

    def _aux_index(self, kind: str, rank: int, name: str, add: bool = True) -> int | None:
        """A tag flow ("tag", rank, tenant) or low group ("low", rank, pool)."""
        key = (kind, rank, name)
        i = self._aux.get(key)
        if i is None:
            i = self._register(_hash("\0" + kind, str(rank), name), _AUX, add)
            if i is not None:
                self._aux[key] = i
        return i

    # -- fair queueing's turns across workers (module doc) ----------------------------------
    def enqueue(self, rank: int, tenant: str, weight: float) -> tuple[int, float] | None:
        """A waiter of `tenant` at priority `rank` queues in this worker, which has already
        published it in its admission depth (the caller holds the admission lock): its tag
        flow and start tag, max(the class's virtual time, the flow's next tag) while the flow
        has waiters in any live worker, else the virtual time. None: the table is full."""
        f = self._aux_index("tag", rank, tenant)
        if f is None:
            return None
        d = self._d
        start = d[self._vt0 + rank]
        if self.waiting(rank, f):
            start = max(start, d[self._next0 + f])
        d[self._next0 + f] = start + 1.0 / max(weight, 1e-9)
        self._q[self._queued0 + f] += 1
        return f, start

    def dequeue(self, f: int) -> None:
        """A waiter of tag flow `f` is gone from this worker (served, timed out, cancelled);
        before the worker un-publishes it from its depth."""
        self._q[self._queued0 + f] -= 1

    def waiting(self, rank: int, f: int) -> int:
        """Waiters of tag flow `f` (priority `rank`) queued in the live workers."""
        if self._rows == 1:
            return self._q[self._queued0 + f]
        sh = self.shared
        assert sh is not None
        return int(self.queued[:, f][sh.depth[:, rank] > 0].sum())

    def tenant_waiting(self, rank: int, tenant: str) -> bool:
        """Has `tenant` waiters of priority `rank` queued in any live worker?"""
        f = self._aux_index("tag", rank, tenant, add=False)
        return f is not None and self.waiting(rank, f) > 0

    def served(self, rank: int, tag: float) -> None:
        """A waiter with start tag `tag` took its slots (under the admission lock): the
        class's virtual time moves up to it."""
        i = self._vt0 + rank
        if tag > self._d[i]:
            self._d[i] = tag

    def low_group(self, rank: int, pool: str) -> int | None:
        """The index under which workers publish their lowest tag waiting for `pool` (the
        caller holds the admission lock)."""
        return self._aux_index("low", rank, pool)

    def publish_low(self, g: int, tag: float | None) -> None:
        """This worker's lowest start tag waiting in low group `g` (None: none)."""
        self._d[self._low0 + g] = 0.0 if tag is None else tag + 1.0

    def lowest_elsewhere(self, rank: int, g: int) -> float:
        """The lowest start tag that another live worker has waiting in low group `g`
        (priority `rank`); +inf when none does."""
        sh = self.shared
        if sh is None:
            return float("inf")
        col = self.low[:, g]
        live = (col > 0.0) & (sh.depth[:, rank] > 0)
        live[self.row] = False
        return float(col[live].min()) - 1.0 if live.any() else float("inf")

    def _refresh(self) -> None:
        """Learn the flows other workers registered since this one last looked."""
        n = int(self.hdr[0])
        for i in range(len(self._group_of), n):
            g = int(self.groups[i])
            self._group_of.append(g)
            self._members.setdefault(g, []).append(i)

    def enter(
        self, rank: int, tenant: str, pool: str, weight: float, now: float
    ) -> tuple[int | None, list[int] | None]:
        """A request of the flow asks for a slot in `pool`: its index (None: the table is
        full), marked active, and `contended`'s answer for it (None when alone)."""
        i = self.flow(rank, tenant, pool, weight)
        if i is None:
            return None, None
        self._d[self._seen0 + i] = now
        return i, self.contended(i, now)

    def leave(self, i: int, n: int, now: float) -> None:
        """`n` slots of flow `i` given back (it was active until now)."""
        self._q[self._row0 + i] -= n
        self._d[self._seen0 + i] = now

    def mark(self, i: int, now: float) -> None:
        self._d[self._seen0 + i] = now

    def add(self, i: int, n: int) -> None:
        self._q[self._row0 + i] += n

    def holding(self, i: int) -> int:
        """Slots flow `i` holds, all workers together."""
        if self._rows == 1:
            return self._q[self._row0 + i]
        return int(self.held[:, i].sum())

    def contended(self, i: int, now: float) -> list[int] | None:
        """The flows active beside flow `i` in its pool and priority (itself included), or
        None when it is alone there: then nothing is kept back, and the caller need not
        look at the pool's room."""
        if self._q[0] != len(self._group_of):
            self._refresh()
        members = self._members.get(self._group_of[i], ())
        if len(members) < 2:
            return None
        d, o = self._d, self._seen0
        active = [j for j in members if j == i or now - d[o + j] < RESERVE_WINDOW_S]
        return active if len(active) > 1 else None

    def holds_back(
        self, i: int, n: int, active: list[int], cap: int, free: int, now: float
    ) -> bool:
        """Must flow `i` leave the `n` slots it asks for to an active tenant under its share?
        `active`: `contended`'s answer; `cap`, `free`: the pool's capacity and free slots."""
        self._sweep(now)
        d, w0 = self._d, self._weight0
        wsum = sum(d[w0 + j] for j in active)
        if (self.holding(i) + n) * wsum <= cap * d[w0 + i]:
            return False  # within its share: it may take the last slot
        under = sum(1 for j in active if j != i and self.holding(j) * wsum < cap * d[w0 + j])
        return free - n < min(under, reserve_cap(cap))

    def _sweep(self, now: float) -> None:
        """Rows of workers that died: the main process zeroed their admission row, so they
        hold no slot; their tenants' counts go too (the caller holds the admission lock)."""
        sh = self.shared
        if sh is None or now - self._swept < SWEEP_S:
            return
        self._swept = now
        dead = ~sh.inflight.any(axis=1) & self.held.any(axis=1)
        if dead.any():
            self.held[dead, :] = 0

    def close(self) -> None:
        self._q.release()
        self._d.release()
        del self.hdr, self.keys, self.groups, self.weight, self.seen, self.held
        del self.queued, self.low
        try:
            self._map.close()
        except BufferError:
            pass
