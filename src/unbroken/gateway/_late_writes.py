"""First tokens before later ones: a stream's later token events, read in one pass of the
event loop, are written to their clients at the end of that pass, after every first token
the same pass read, and after the tasks those reads woke (a new stream's first event is
written by its task, with the response's headers).

Why: an engine's step ends with one event for each of its running streams, and the gateway
reads them in one or a few passes of its event loop, in the order the kernel reports the
sockets. Written as read, a request's first token waits behind up to a hundred other
streams' tokens (each a decode, a write, and on a small machine a wake-up of the client that
may take the core): a few milliseconds that land in the TTFT tail, since they hit exactly
the requests that just started. Held to the end of the pass, a later token is written at
most two passes later than it was read (its inter-token time moves by that, once: the
following tokens are held the same), and a first token goes out before any of them.

A relay holds its later tokens here only while nothing of its stream waits in its task's
queue, and every other write of a stream (a break, its end, a handover) first lets what is
held go (`flush`), so a stream's bytes stay in order.
"""

from __future__ import annotations

import asyncio
import os
import weakref
from collections.abc import Callable

__all__ = ["ENABLED", "LateWrites", "for_loop"]

# Off only to measure what it is worth (benchmarks/steady_tail.py --variant).
ENABLED = os.environ.get("UNBROKEN_FIRST_TOKENS_FIRST", "1") != "0"


class LateWrites:
    """The held writes of one event loop: (write, bytes) in the order they were read."""

    __slots__ = ("_items", "_loop", "_scheduled")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items: list[tuple[Callable[[bytes], None], bytes]] = []
        self._scheduled = False

    def hold(self, write: Callable[[bytes], None], data: bytes) -> None:
        """`write(data)` once the callbacks this pass of the loop made due have run (or at
        the next `flush`)."""
        self._items.append((write, data))
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._arm)

    def _arm(self) -> None:
        # Runs among the callbacks that this pass's reads made due, in order: the tasks that
        # write a new stream's first event with its response headers (`_stream_state._send`)
        # and that forward new requests to the engines. The flush goes after all of them.
        self._loop.call_soon(self.flush)

    def flush(self) -> None:
        """Write everything held now, in the order it was held."""
        self._scheduled = False
        while self._items:
            items, self._items = self._items, []
            for write, data in items:
                write(data)


_BY_LOOP: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LateWrites] = (
    weakref.WeakKeyDictionary()
)


def for_loop(loop: asyncio.AbstractEventLoop) -> LateWrites:
    """The loop's one `LateWrites` (one per loop, so that all streams' first tokens of a
    pass go before all their later ones)."""
    lw = _BY_LOOP.get(loop)
    if lw is None:
        lw = _BY_LOOP[loop] = LateWrites(loop)
    return lw
