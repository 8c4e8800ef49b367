"""The prefix index's storage: one fixed-size table shared by every worker of a gateway.

`PrefixIndex` (`_prefix.py`) asks two things: record that a prompt's block names were sent to
an endpoint, and how many leading blocks of a prompt an endpoint holds. With `--workers N`
each worker sees ~1/N of the requests, so a per-worker index missed what the others sent
(benchmarks/routing.py's shared-prefix hit rate: median 72 % at 2 workers against 90 % at 1,
docs/bench.md). This table is the index
of all of them: a file in the main process's private temporary directory that every worker
maps (as `_shared.py`'s admission table), or anonymous memory for a single-process gateway
and in-process tests (same class, same behaviour).

Layout (little-endian int64 words; one entry per (block, endpoint column) pair):

    header[8]      magic, entries, ways, columns
    clock[1 + col] blocks new to the column recorded so far (its LRU clock); clock[0] =
                   2^62, so an empty entry (column field 0, stamp 0) is the oldest of all
    gen[col]       bumped when the column goes to another endpoint
    tag[entry]     block | (col + 1) << 32 | (gen & 0xFFFF) << 48; 0: empty
    stamp[entry]   the column's clock when the block was last recorded there

Entries are in buckets of `ways` (set-associative, 8 ways): a (block, column) pair lives in
bucket `(block ^ salt(col)) mod buckets`. A lookup reads one bucket (a few memoryview reads,
no lock, no syscall); a record is one vectorised numpy pass over a prompt's blocks. An entry
counts while fewer than `bound` (`prefix_index_blocks`) blocks new to its column have been
recorded since it was last recorded: the former per-endpoint LRU list of `bound` distinct
blocks, identical to it while nothing ages out (checked on random sequences), except that a
block sent again is refreshed without pushing an older one out, so a column may count up to
`bound` + the blocks re-sent meanwhile: more than an exact LRU keeps, never less. A prompt's
new blocks are stamped head newest, so its tail ages first and what counts stays a leading
run. A full bucket replaces its oldest entry: empty, a cleared column's, stale, then the
least recently recorded in its own column's clock.

Concurrency: none of it is locked. Workers write entries without coordination; each 8-byte
word is written whole (aligned stores), the stamp before its tag. What a race can do: two
workers pick the same free way and one record of a block is lost; a lookup sees a tag with
another write's stamp; a clock increment is lost, so ages run a little slow. Each of these
misstates what one endpoint holds for one prompt, for one routing decision (a record of the
next request with that prefix repairs it), which the approximate index already tolerates
(an engine evicts blocks the index still lists). Nothing a race writes can make a column of
a removed endpoint look alive for another: `clear` (the main process, when a column goes to
a new endpoint; the local table on `forget`) bumps the generation, which is part of every
tag, and moves the clock 2^32 ahead, which makes every older stamp stale.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from array import array
from collections.abc import Sequence
from pathlib import Path

import numpy as np

__all__ = ["DEFAULT_WAYS", "MAX_COLUMNS", "PrefixTable", "table_entries"]

MAGIC = 0x7072656678746231  # "prefxtb1"
MAX_COLUMNS = 1024  # as many as the admission table's endpoint columns (`_shared.py`)
DEFAULT_WAYS = 8
_HEADER = 8  # int64 words
_CLEAR_JUMP = 1 << 32  # past any bound: every stamp before a clear is stale
_SALT = 0x9E3779B1  # a column's buckets are its blocks' XOR this x (col + 1)
_EMPTY_AGE = np.int64(1 << 62)  # clock[0], so an empty way (stamp 0) is the oldest
_HIT_AGE = np.int64((1 << 62) + 1)  # the way already holding the pair: above all others


def table_entries(blocks_per_endpoint: int) -> int:
    """Entries for an index bound of `blocks_per_endpoint`: room for 32 endpoints' full
    bounds at half occupancy, as a power of two, between 2^12 and 2^22 (16 B each: 8 MiB
    at the default bound of 16,384)."""
    want = max(1, blocks_per_endpoint) * 32
    return min(1 << 22, max(1 << 12, 1 << (want - 1).bit_length()))


class PrefixTable:
    """(block, column) -> recency stamp, fixed size (module doc)."""

    def __init__(
        self,
        entries: int = 1 << 19,
        *,
        path: Path | None = None,
        create: bool = False,
        ways: int = DEFAULT_WAYS,
    ) -> None:
        self.path = path
        self._fd = -1
        if path is not None and not create:  # a worker: the main process's table, as made
            self._fd = os.open(path, os.O_RDWR)
            head = np.frombuffer(os.pread(self._fd, 8 * _HEADER, 0), dtype=np.int64)
            if int(head[0]) != MAGIC:
                os.close(self._fd)
                raise ValueError(f"{path}: not a prefix table")
            entries, ways = int(head[1]), int(head[2])
        if entries < ways or entries & (entries - 1) or ways & (ways - 1):
            raise ValueError("entries and ways must be powers of two, entries >= ways")
        self.entries, self.ways = entries, ways
        size = 8 * (_HEADER + 1 + 2 * MAX_COLUMNS + 2 * entries)
        if path is None:
            self._map = mmap.mmap(-1, size)  # anonymous: zeroed, pages taken as touched
        else:
            if create:
                self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                os.ftruncate(self._fd, size)
            self._map = mmap.mmap(self._fd, size)
        words = np.frombuffer(self._map, dtype=np.int64)
        o = _HEADER
        if path is None or create:
            words[:4] = (MAGIC, entries, ways, MAX_COLUMNS)
            words[o] = _EMPTY_AGE
        # By the tag's column field (col + 1): [0] is the empty entries' sentinel.
        self._clock = words[o : o + 1 + MAX_COLUMNS]
        self._gen = words[o + 1 + MAX_COLUMNS : o + 1 + 2 * MAX_COLUMNS]
        g = o + 1 + MAX_COLUMNS
        o += 1 + 2 * MAX_COLUMNS
        self._tags = words[o : o + entries].view(np.uint64)
        self._tag_cols = self._tags.view(np.uint16)[2::4]  # the column field, unshifted
        self._stamps = words[o + entries : o + 2 * entries]
        # Scalar reads for lookups: a memoryview item is ~3x cheaper than a numpy scalar.
        mv = memoryview(self._map)
        self._mv = mv
        self._tag_mv = mv[8 * o : 8 * (o + entries)].cast("Q")
        self._stamp_mv = mv[8 * (o + entries) : 8 * (o + 2 * entries)].cast("q")
        self._clock_mv = mv[8 * (_HEADER + 1) : 8 * g].cast("q")  # by col
        self._gen_mv = mv[8 * g : 8 * (g + MAX_COLUMNS)].cast("q")
        self._bucket_mask = entries // ways - 1
        self._way = np.arange(ways, dtype=np.intp)

    @property
    def nbytes(self) -> int:
        return len(self._map)

    def _high(self, col: int) -> int:
        """The column's and its generation's part of a tag."""
        return (((self._gen_mv[col] & 0xFFFF) << 16) | (col + 1)) << 32

    # -- lookups (per candidate, per request: pure Python on memoryviews) ------------------
    def cached(self, col: int, blocks: Sequence[int], bound: int) -> int:
        """How many leading blocks of `blocks` column `col` holds: a binary search over
        them (what counts is a leading run, module doc), first and last block first."""
        n = len(blocks)
        if not n or not 0 <= col < MAX_COLUMNS:
            return 0
        high = self._high(col)
        oldest = self._clock_mv[col] - bound  # stamps above this count
        salt = (col + 1) * _SALT & 0xFFFFFFFF
        tags, stamps, ways, mask = self._tag_mv, self._stamp_mv, self.ways, self._bucket_mask

        def held(block: int) -> bool:
            tag = block | high
            base = ((block ^ salt) & mask) * ways
            for i in range(base, base + ways):
                if tags[i] == tag:
                    return stamps[i] > oldest
            return False

        if not held(blocks[0]):
            return 0  # the usual answer for a candidate that never saw this prefix
        if held(blocks[-1]):
            return n
        lo, hi = 1, n - 1  # blocks[:lo] held; blocks[hi] not
        while lo < hi:
            mid = (lo + hi) // 2
            if held(blocks[mid]):
                lo = mid + 1
            else:
                hi = mid
        return lo

    # -- records (once per admitted request: one numpy pass) -------------------------------
    def record(self, col: int, blocks: list[int], bound: int) -> None:
        """`blocks` (a prompt's names, head first) were sent to column `col`. The column's
        clock advances by the blocks it did not hold (within `bound`): a block sent again is
        refreshed, not counted again, as in an LRU list of distinct blocks. The blocks it
        held get the newest stamp, the new ones stamps that age from the tail."""
        n = len(blocks)
        if not n or not 0 <= col < MAX_COLUMNS:
            return
        b = np.frombuffer(array("Q", blocks), dtype=np.uint64)
        tags = b | np.uint64(self._high(col))
        salt = np.uint64((col + 1) * _SALT & 0xFFFFFFFF)
        bucket = ((b ^ salt) & np.uint64(self._bucket_mask)).astype(np.intp) * self.ways
        slot = bucket + self._victims(bucket[:, None] + self._way, tags)
        c0 = self._clock_mv[col]
        # A row whose way holds its pair, still counted: a block the column holds.
        new = (self._tags[slot] != tags) | (self._stamps[slot] <= c0 - bound)
        behind = np.cumsum(new[::-1])[::-1]  # new blocks from each row to the tail
        m = int(behind[0])
        self._clock_mv[col] = c0 + m  # not atomic across workers: a lost add is benign
        stamps = c0 + np.where(new, behind, m)
        for _ in range(4):  # rows that shared a bucket with another row of this prompt
            self._stamps[slot] = stamps
            self._tags[slot] = tags
            # Several rows of one prompt may have chosen one way: the last write won.
            lost = np.flatnonzero(self._tags[slot] != tags)
            if not len(lost):
                return
            bucket, tags, stamps = bucket[lost], tags[lost], stamps[lost]
            slot = bucket + self._victims(bucket[:, None] + self._way, tags)

    def _victims(self, idx: np.ndarray, rows_t: np.ndarray) -> np.ndarray:
        """Per row, the way to write: the one holding its pair, else the oldest in its own
        column's clock: an empty one (the sentinel clock), a cleared column's (its clock
        jumped), a stale one, then the least recently recorded."""
        age = self._clock[self._tag_cols[idx].astype(np.intp)] - self._stamps[idx]
        age[self._tags[idx] == rows_t[:, None]] = _HIT_AGE
        return age.argmax(axis=1)

    # -- columns ---------------------------------------------------------------------------
    def clear(self, col: int) -> None:
        """Column `col` holds nothing from now on (it goes to another endpoint, or its
        endpoint is gone): its generation changes and its clock jumps past every bound."""
        self._gen_mv[col] = self._gen_mv[col] + 1
        self._clock_mv[col] = self._clock_mv[col] + _CLEAR_JUMP

    def live(self, bound: int, col: int | None = None) -> int:
        """Entries that count, in column `col` or all (a scan of the whole table: tests)."""
        k = self._tag_cols.astype(np.intp)  # col + 1; 0: empty
        gen = (self._tags >> np.uint64(48)).astype(np.int64)
        ok = (k > 0) & (gen == self._gen[np.maximum(k - 1, 0)] & 0xFFFF)
        ok &= self._clock[k] - self._stamps < bound
        if col is not None:
            ok &= k == col + 1
        return int(ok.sum())

    def close(self) -> None:
        # The numpy and memoryview views hold the buffer; drop them before the map.
        for mv in (self._tag_mv, self._stamp_mv, self._clock_mv, self._gen_mv, self._mv):
            mv.release()
        del self._clock, self._gen, self._tags, self._tag_cols, self._stamps
        with contextlib.suppress(BufferError):
            self._map.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
