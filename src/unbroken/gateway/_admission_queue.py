"""Admission's queue (`_admission.Admission`): the priorities, a waiter, and the heap of
waiters in their turn's order (priority, then start-time fair queueing's virtual start tag
over tenants, then arrival; see `_admission`'s module doc).

Apart from `Admission` so that the order waiters are served in, and the heap operations that
keep it, are read in one place; `Admission` holds the caps, the reserve and the demand.
"""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Iterator
from dataclasses import dataclass, field

from unbroken.gateway._pool import Endpoint
from unbroken.gateway._prefix import RouteHint

__all__ = ["PRIORITIES", "in_order", "remove"]

PRIORITIES = ("critical", "standard", "sheddable")
_RANK = {p: i for i, p in enumerate(PRIORITIES)}
_Kind = tuple[str, str, int, str | None]  # a waiter's model, priority, weight, tenant


@dataclass(eq=False)  # identity: finding one in the queue is a C-level scan
class _Waiter:
    rank: int
    vt: float  # virtual start tag within its priority (fair queueing over tenants)
    seq: int
    model: str = field(compare=False)
    priority: str = field(compare=False)
    exclude: tuple[Endpoint, ...] = field(compare=False)
    future: asyncio.Future[tuple[Endpoint, int]] = field(compare=False)
    weight: int = field(compare=False, default=1)
    size: int = field(compare=False, default=0)
    deferred: float | None = field(compare=False, default=None)
    hint: RouteHint | None = field(compare=False, default=None)
    want: str | None = field(compare=False, default=None)  # the pool it counts toward
    tenant: str | None = field(compare=False, default=None)
    share: float = field(compare=False, default=1.0)  # the tenant's weight
    # With workers: its tenant's tag flow and the low group it is published in (`_fairshare`:
    # its tag is on the workers' shared clock), and whether it has left the queue.
    tag_flow: int | None = field(compare=False, default=None)
    low_group: int | None = field(compare=False, default=None)
    left: bool = field(compare=False, default=False)

    def __lt__(self, other: _Waiter) -> bool:  # its turn: priority, start tag, arrival
        return (self.rank, self.vt, self.seq) < (other.rank, other.vt, other.seq)


def remove(h: list[_Waiter], w: _Waiter) -> bool:
    """Take `w` out of the heap `h` in O(log n) (the last entry takes its place and moves up
    or down); False when it is not there."""
    try:
        i = h.index(w)
    except ValueError:
        return False
    last = h.pop()
    if i < len(h):
        h[i] = last
        if i > 0 and last < h[(i - 1) // 2]:
            heapq._siftdown(h, 0, i)  # type: ignore[attr-defined]
        else:
            heapq._siftup(h, i)  # type: ignore[attr-defined]
    return True


def in_order(h: list[_Waiter]) -> Iterator[_Waiter]:
    """The waiters in their turn's order, lazily: a pass that stops after a few (a slot
    freed in a full pool) costs a few heap steps, not a sort of the whole queue (about a
    millisecond for a few hundred waiters, at every release). The heap must not change
    meanwhile (`Admission.wake` forgets the served after its pass)."""
    if not h:
        return
    front = [(h[0].rank, h[0].vt, h[0].seq, 0)]
    while front:
        i = heapq.heappop(front)[3]
        yield h[i]
        for c in (2 * i + 1, 2 * i + 2):
            if c < len(h):
                w = h[c]
                heapq.heappush(front, (w.rank, w.vt, w.seq, c))
