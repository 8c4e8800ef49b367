"""What each gateway replica sent where, told to the others over Redis (`prefix_share_url`),
so that N replicas behind one Kubernetes Service keep one replica's prefix hit rate.

Why: replicas agree on homes (rendezvous hashing over the same endpoints), but each one's
index learns only what it sent itself; a prefix that one replica placed away from its home
under load is unknown to the others, and a shared-prefix workload through two replicas hit
63 % of prompt tokens against 80-90 % through one (docs/gateway.md). Workers of one replica
already share one table (`_prefix_table.py`); this is the same for replicas.

The serving processes publish each admitted leg's (endpoint, block names) on one channel,
batched per pass of the event loop; the process that owns the index (the main process with
workers, else the only one) subscribes and records the other replicas' into its index as if
it had sent them itself (the replica's own are skipped: they are in its table already).
Endpoints are named alike in every replica (address, or EndpointSlice discovery), and so
are blocks (CRC-32 of the prompt's text), so a record means the same everywhere.

Best effort by design: the index is approximate and a lost record costs one routing
decision's credit. Redis unreachable: records are dropped (not queued without bound), said
once, and the subscriber reconnects with a back-off; requests never wait on Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

import orjson

__all__ = ["CHANNEL", "PrefixShare", "replica_id"]

log = logging.getLogger("unbroken.gateway")

CHANNEL = "unbroken:prefix-blocks:v1"
MAX_PENDING = 4096  # records held while a publish is in flight; beyond, dropped
DOWN_RETRY_S = 1.0


def replica_id(owner_pid: int | None = None) -> str:
    """This gateway replica's name on the channel: host and the index owner's pid (a
    worker passes its main process's)."""
    return f"{socket.gethostname()}/{owner_pid or os.getpid()}"


class PrefixShare:
    """One process's link to the channel: `publish` (serving processes) and, with `apply`,
    a subscriber that hands other replicas' records to it (the index's owner)."""

    def __init__(
        self,
        url: str,
        replica: str,
        apply: Callable[[str, list[int]], None] | None = None,
        bound: int = 16384,
    ) -> None:
        self.url = url
        self.replica = replica
        self.apply = apply
        self.bound = bound  # blocks per record kept (the index keeps no more per endpoint)
        self._redis: Any = None
        self._pending: list[tuple[str, Sequence[int]]] = []
        self._sender: asyncio.Task[None] | None = None
        self._listener: asyncio.Task[None] | None = None
        self._down_until = 0.0
        self._said_down = False
        self.published = 0  # records sent
        self.applied = 0  # other replicas' records recorded here
        self.dropped = 0  # records lost to a full queue or an unreachable Redis

    async def start(self) -> None:
        import redis.asyncio as aredis

        self._redis = aredis.from_url(
            self.url, socket_connect_timeout=2.0, socket_timeout=5.0, health_check_interval=30
        )
        if self.apply is not None:
            self._listener = asyncio.create_task(self._listen())

    async def close(self) -> None:
        for t in (self._listener, self._sender):
            if t is not None:
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
        if self._redis is not None:
            with contextlib.suppress(Exception):
                await self._redis.aclose()

    # -- publishing --------------------------------------------------------------------------
    def publish(self, endpoint: str, blocks: Sequence[int]) -> None:
        """Note that `blocks` were sent to `endpoint`; sent with the others of this loop pass."""
        if self._redis is None or not len(blocks):
            return
        if len(self._pending) >= MAX_PENDING or time.monotonic() < self._down_until:
            self.dropped += 1
            return
        self._pending.append((endpoint, blocks[: self.bound]))  # a list: BlockNames' slice
        if self._sender is None or self._sender.done():
            self._sender = asyncio.get_running_loop().create_task(self._send())

    async def _send(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, []
            try:
                await self._redis.publish(CHANNEL, orjson.dumps([self.replica, batch]))
            except Exception as e:  # redis's errors, OSError, timeouts: all mean "not now"
                self.dropped += len(batch) + len(self._pending)
                self._pending = []
                self._down(e)
                return
            self.published += len(batch)
            self._up()

    # -- subscribing -------------------------------------------------------------------------
    async def _listen(self) -> None:
        backoff = 0.5
        while True:
            try:
                async with self._redis.pubsub(ignore_subscribe_messages=True) as ps:
                    await ps.subscribe(CHANNEL)
                    self._up()
                    backoff = 0.5
                    while True:
                        msg = await ps.get_message(timeout=5.0)
                        if msg is not None and msg.get("type") == "message":
                            self._take(msg["data"])
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self._down(e)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    def _take(self, data: bytes) -> None:
        assert self.apply is not None
        try:
            replica, batch = orjson.loads(data)
            if replica == self.replica:
                return  # this replica's own: already in its table
            for endpoint, blocks in batch:
                if isinstance(endpoint, str) and isinstance(blocks, list):
                    self.apply(endpoint, blocks)
                    self.applied += 1
        except (orjson.JSONDecodeError, TypeError, ValueError) as e:
            log.debug("prefix share: a message not of this version: %s", e)

    # -- health ------------------------------------------------------------------------------
    def _down(self, e: BaseException) -> None:
        self._down_until = time.monotonic() + DOWN_RETRY_S
        if not self._said_down:
            self._said_down = True
            log.warning(
                "prefix share: Redis at %s unreachable (%s: %s): routing goes on with this "
                "replica's own index",
                self.url,
                type(e).__name__,
                e,
            )

    def _up(self) -> None:
        if self._said_down:
            self._said_down = False
            log.info("prefix share: Redis at %s reachable again", self.url)
