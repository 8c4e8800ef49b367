"""Admission: per-endpoint in-flight caps, a priority queue for requests over the caps, and
shedding.

A request takes a slot on an endpoint (`acquire`) and gives it back (`release`). When no
endpoint allowed for its priority has room, critical and standard requests wait (critical
first, FIFO within a class) up to the queue timeout; sheddable requests get 429 at once.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from unbroken.gateway._pool import Endpoint, Pool
from unbroken.wire.errors import ApiError

__all__ = ["PRIORITIES", "Admission"]

PRIORITIES = ("critical", "standard", "sheddable")
_RANK = {p: i for i, p in enumerate(PRIORITIES)}


@dataclass(order=True)
class _Waiter:
    rank: int
    seq: int
    model: str = field(compare=False)
    priority: str = field(compare=False)
    exclude: tuple[Endpoint, ...] = field(compare=False)
    future: asyncio.Future[Endpoint] = field(compare=False)


class Admission:
    def __init__(self, pool: Pool, *, queue_timeout: float, retry_after: int = 1) -> None:
        self.pool = pool
        self.queue_timeout = queue_timeout
        self.retry_after = retry_after
        self._heap: list[_Waiter] = []
        self._seq = itertools.count()
        self.depth = dict.fromkeys(PRIORITIES, 0)

    def _take(self, ep: Endpoint) -> Endpoint:
        ep.inflight += 1
        ep.served += 1
        return ep

    async def acquire(
        self, model: str, priority: str, exclude: Iterable[Endpoint] = ()
    ) -> tuple[Endpoint, float]:
        """A slot on an endpoint, and the seconds spent queued for it."""
        exclude = tuple(exclude)
        ep = self.pool.pick(model, priority, exclude)
        if ep is not None and not self._heap:
            return self._take(ep), 0.0
        if ep is not None and not any(w.rank <= _RANK[priority] for w in self._heap):
            return self._take(ep), 0.0
        if priority == "sheddable":
            raise ApiError(
                429,
                "the service is at capacity; sheddable requests are refused until there is room",
                code="shed",
                headers={"Retry-After": str(self.retry_after)},
            )
        loop = asyncio.get_running_loop()
        w = _Waiter(
            _RANK[priority], next(self._seq), model, priority, exclude, loop.create_future()
        )
        heapq.heappush(self._heap, w)
        self.depth[priority] += 1
        t0 = time.monotonic()
        granted = False
        try:
            self.wake()
            ep = await asyncio.wait_for(asyncio.shield(w.future), self.queue_timeout)
            granted = True
            return ep, time.monotonic() - t0
        except TimeoutError:
            raise ApiError(
                429,
                f"no capacity within the queue timeout ({self.queue_timeout:g} s)",
                code="queue_timeout",
                headers={"Retry-After": str(self.retry_after)},
            ) from None
        finally:
            if not w.future.done():
                w.future.cancel()
            elif not granted and not w.future.cancelled():
                self.release(w.future.result())  # a slot arrived as we were cancelled
            self._forget(w)

    def _forget(self, w: _Waiter) -> None:
        try:
            self._heap.remove(w)
            heapq.heapify(self._heap)
            self.depth[w.priority] -= 1
        except ValueError:
            pass

    def release(self, ep: Endpoint) -> None:
        ep.inflight -= 1
        if self._heap:
            self.wake()

    def wake(self) -> None:
        """Hand free slots to waiters, best priority first."""
        if not self._heap:
            return
        served: list[_Waiter] = []
        for w in sorted(self._heap):
            if w.future.done():
                served.append(w)
                continue
            ep = self.pool.pick(w.model, w.priority, w.exclude)
            if ep is None:
                continue
            w.future.set_result(self._take(ep))
            served.append(w)
        for w in served:
            self._forget(w)
