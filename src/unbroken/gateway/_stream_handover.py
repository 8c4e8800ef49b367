"""A stream moved, with its client's connection, to another process at a reload
(`HandoverRelay`, a layer of `_stream.StreamRelay`): the old process cuts its leg between two
events (`hand_over`) and writes down what the stream is (`snapshot`, a
`_messages.StreamState`); the new one rebuilds it (`restore`) and carries it on by
continuation (`resume`). The processes' side of a reload is `_handover` and `_handover_in`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Self

from unbroken.gateway._messages import StreamState
from unbroken.gateway._relay import ClientSink
from unbroken.gateway._stream_breaks import HANDOVER, BreakingRelay
from unbroken.gateway._stream_host import RelayHost

__all__ = ["HandoverRelay"]


class HandoverRelay(BreakingRelay):
    """A stream's handover to another process (module doc)."""

    __slots__ = ()

    if TYPE_CHECKING:

        def interrupt(self, reason: str) -> None:
            """Cut the current leg: `_stream.StreamRelay.interrupt`."""

    def hand_over(self, transfer: Callable[[Self], Awaitable[bool]]) -> bool:
        """Cut the current leg between two events (the engine frees the request) so that
        `transfer` can move the stream, with its client connection, to another process
        (`_handover`, at a reload). `transfer` runs in this stream's task once everything
        relayed so far was handed to the client's sink; when it returns False the stream
        continues here, by continuation, as after any other break. False, and nothing done,
        when no leg is running or the client has not had the response's headers yet."""
        if self.interrupted is not None or self.up is None or self.sink is None:
            return False
        self._handoff = transfer
        self.interrupt(HANDOVER)
        return True

    def snapshot(self) -> StreamState:
        """What another process needs to carry this stream on (all but the body's bytes,
        which travel beside it; `_messages.StreamState`): see `restore`."""
        x = self.x
        t = x.tracker
        return {
            "path": self.path,
            "chat": self.chat,
            "model": self.model,
            "priority": self.priority,
            "headers": {str(k): str(v) for k, v in self.headers.items()},  # not istr keys
            "t0": self.t0,  # CLOCK_MONOTONIC: the same clock in every process of the host
            "weight": self.weight,
            "augmented": x.augmented,
            "wants": [x.want_usage, x.want_cont, x.want_ids],
            "migrations": self.migrations,
            "failed": [e.name for e in self.failed],
            "sent": x.sent,
            "exact": x.exact,
            "prompt_tokens": x.prompt_tokens,
            "prompt_ids": x.prompt_ids,
            "gen_ids": x.gen_ids,
            "ids_ok": x.ids_ok,
            "split_back": x.split_back,
            "legs": x.legs,
            "gaps": self._gaps,
            "gap_max": self._gap_max,
            "last_token": self._last_token,
            "pool": self.ep.pool if self.ep is not None else None,
            "tracker": {
                "id": t.id,
                "created": t.created,
                "model": t.model,
                "texts": {str(i): "".join(v) for i, v in t.texts.items()},
                "finish": {str(i): v for i, v in t.finish.items()},
                "role_sent": sorted(t.role_sent),
                "token_events": t.token_events,
            },
        }

    @classmethod
    def restore(cls, host: RelayHost, state: StreamState, body: bytes) -> Self:
        """A stream another process handed over (`snapshot`); `resume` continues it."""
        wants = state["wants"]
        r = cls(
            host,
            None,  # type: ignore[arg-type]  # no aiohttp request: the sink is the connection
            path=state["path"],
            body=body,
            chat=state["chat"],
            model=state["model"],
            priority=state["priority"],
            headers=state["headers"],
            t0=state["t0"],
            weight=state["weight"],
            augmented=state["augmented"],
            wants=(wants[0], wants[1], wants[2]),
        )
        r.migrations = state["migrations"]
        r.x.sent = state["sent"]
        r.x.exact = state["exact"]
        r.x.prompt_tokens = state["prompt_tokens"]
        r.x.prompt_ids = state["prompt_ids"]
        r.x.gen_ids = state["gen_ids"]
        r.x.ids_ok = state["ids_ok"]
        r.x.split_back = state["split_back"]
        r.x.legs = state["legs"]
        r._gaps, r._gap_max = state["gaps"], state["gap_max"]
        if state["last_token"] and state["pool"] is not None:
            r._last_token = state["last_token"]
            r._itl = host.metrics.for_pool(state["pool"])[1]
        tr, t = state["tracker"], r.x.tracker
        t.id, t.created, t.model = tr["id"], tr["created"], tr["model"]
        t.texts = {int(i): [v] for i, v in tr["texts"].items()}
        t.finish = {int(i): v for i, v in tr["finish"].items()}
        t.role_sent = set(tr["role_sent"])
        t.token_events = tr["token_events"]
        return r

    async def resume(self, sink: ClientSink) -> None:
        """Carry on a stream handed over by another process, writing to `sink` (its client's
        connection, adopted): its leg was cut there, so the next one starts at once, by
        continuation."""
        self.sink, self.resp = sink, sink.resp
        await self.run(None, None)
