"""Loop-side state of one HTTP request, and its ids."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

from unbroken.engine.core import Output

__all__ = ["INT64_MAX", "INT64_MIN", "RequestState", "client_request_id"]

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def client_request_id(header: str | None) -> str:
    """vLLM's convention: a caller's X-Request-Id becomes the response id. Used for the
    response and the logs only: two requests may carry the same one."""
    rid = header or ""
    return rid if 0 < len(rid) <= 128 and rid.isprintable() else uuid.uuid4().hex


class RequestState:
    """Outputs handed over by the core, per choice. `request_id` is what the client sees;
    `key` is unique within the process and names the request to the core (aborts, tracking),
    so a client reusing an id cannot abort or hijack another request."""

    __slots__ = (
        "arrival",
        "created",
        "event",
        "fail_after",
        "finish",
        "first",
        "key",
        "last",
        "n",
        "pending",
        "remaining",
        "request_id",
        "texts",
        "tokens",
    )

    def __init__(self, request_id: str, n: int) -> None:
        self.request_id = request_id
        self.key = uuid.uuid4().hex
        self.n = n
        self.created = int(time.time())
        self.arrival = time.monotonic()
        self.pending: list[Output] = []
        self.event = asyncio.Event()
        self.remaining = n
        self.first: list[float | None] = [None] * n
        self.last = [0.0] * n
        self.tokens = [0] * n
        self.texts: list[list[str]] = [[] for _ in range(n)]
        self.finish: list[str | None] = [None] * n
        self.fail_after: int | None = None

    def push(self, out: Output) -> None:
        self.pending.append(out)
        i = out.seq.index
        self.tokens[i] += out.tokens
        if out.finish_reason is not None:
            self.finish[i] = out.finish_reason
            self.remaining -= 1
        self.event.set()

    @property
    def done(self) -> bool:
        return self.remaining == 0

    async def batches(self) -> AsyncIterator[list[Output]]:
        while True:
            if not self.pending:
                if self.remaining == 0:
                    return
                self.event.clear()
                await self.event.wait()
                continue
            batch, self.pending = self.pending, []
            yield batch
