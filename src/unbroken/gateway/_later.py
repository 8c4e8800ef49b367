"""New work before later tokens: what a stream's engine sends after its first token is
taken in, decoded and written once the work that the same pass of the event loop made due
has run: new requests forwarded to the engines, new streams' first events written.

Why: an engine's step ends with one event for each of its running streams, and the gateway
reads them in one or a few passes of its event loop. Handled as read (decoded, accounted,
written: ~35 us each), a burst of a hundred holds up, for a few milliseconds, everything
else the gateway has to do: a request that arrives then reaches its engine after the engine
has begun its next step, and waits for that whole step too (its first token one step
later: in `unbroken demo`'s steady window the engines' TTFT p90 was 4-9 ms higher through
unbroken than through a round-robin, with the same p50); a new stream's first token waits
behind the burst's writes. Held here, a later token is taken at most two passes later than
it was read (its inter-token time moves by that, once: the following ones are held the
same), and the read callback costs a list append.

A relay holds its chunks here from its first token on, and its leg's end too while it has
chunks held, so that a stream's chunks are taken in order. A held chunk of a leg that has
ended since (a break, the client gone, a handover) is dropped: the stream's state (what the
client was sent, where a continuation resumes) never included it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["ENABLED", "Later", "for_loop"]

log = logging.getLogger("unbroken.gateway")

# Off only to measure what it is worth (benchmarks/steady_tail.py --variant).
ENABLED = os.environ.get("UNBROKEN_FIRST_TOKENS_FIRST", "1") != "0"


class Later:
    """One event loop's held work: (callback, argument), run in the order held."""

    __slots__ = ("_items", "_loop", "_running", "_scheduled")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items: deque[tuple[Callable[[Any], None], Any]] = deque()
        self._scheduled = False
        self._running = False

    def hold(self, fn: Callable[[Any], None], arg: Any) -> None:
        """`fn(arg)` once the callbacks this pass of the loop made due have run."""
        self._items.append((fn, arg))
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._arm)

    def _arm(self) -> None:
        # Runs among the callbacks that this pass's reads made due, in order: the tasks that
        # forward new requests to the engines and write new streams' first events. The held
        # work goes after all of them.
        self._loop.call_soon(self.run)

    def run(self) -> None:
        """Run everything held, in order (what a held callback holds runs too)."""
        self._scheduled = False
        if self._running:
            return
        self._running = True
        items = self._items
        try:
            while items:
                fn, arg = items.popleft()
                try:
                    fn(arg)
                except Exception:
                    # One stream's fault must not stop the others' held work (in the read
                    # callback it would have ended only that connection's read).
                    log.exception("relaying a held chunk failed")
        finally:
            self._running = False


_BY_LOOP: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Later] = weakref.WeakKeyDictionary()


def for_loop(loop: asyncio.AbstractEventLoop) -> Later:
    """The loop's one `Later` (one per loop: every stream's later tokens of a pass go after
    all of the pass's new work)."""
    lw = _BY_LOOP.get(loop)
    if lw is None:
        lw = _BY_LOOP[loop] = Later(loop)
    return lw
