"""Server-sent events: an incremental decoder with no I/O, and the encoder.

The decoder is fed raw bytes as they arrive (`iter_any()`), keeps its own line buffer so no
line-length limit of the transport applies, and returns complete events. Each event keeps its
raw bytes so a relay can forward it untouched (`plain`: the raw bytes are exactly one
`data: ...` line and its blank line, so forwarding them adds nothing the data does not say).

Decoding is linear in the bytes fed: each `feed` searches only its new bytes (plus one byte
of overlap for a separator split across reads), and an event may be at most `max_event`
bytes: past that, `feed` raises `EventTooLarge` (an engine that never sends the blank line
between events, or one huge line, must not grow the buffer, nor the time spent on it,
without bound).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

__all__ = [
    "DONE",
    "MAX_EVENT_BYTES",
    "EventTooLarge",
    "SSEDecoder",
    "SSEEvent",
    "encode_comment",
    "encode_data",
    "encode_json",
]

DONE = b"[DONE]"
# Larger than any legitimate chunk: a first chunk carrying a long prompt's token ids or its
# echo with logprobs is hundreds of KB; token chunks are a few hundred bytes.
MAX_EVENT_BYTES = 16 * 1024 * 1024


class EventTooLarge(ValueError):
    """An event (or the bytes since the last event's end) passed the decoder's bound."""


@dataclass(slots=True)
class SSEEvent:
    raw: bytes  # the event as received (line ends normalised to LF), terminator included
    data: bytes | None  # joined `data:` lines, None for events without one
    plain: bool = False  # raw == b"data: " + data + b"\n\n"

    @property
    def is_done(self) -> bool:
        return self.data == DONE

    def json(self) -> Any:
        return orjson.loads(self.data) if self.data is not None else None


class SSEDecoder:
    """Splits a byte stream into SSE events. Handles LF, CRLF and CR line ends and any split
    of the stream across `feed` calls, in time linear in the bytes fed."""

    __slots__ = ("_buf", "_cr", "max_event")

    def __init__(self, max_event: int | None = MAX_EVENT_BYTES) -> None:
        self._buf = bytearray()
        self._cr = False  # the last chunk ended in CR: maybe the first half of a CRLF
        self.max_event = max_event

    def one(self, chunk: bytes) -> bytes | None:
        """The data of `chunk` when it is exactly one plain `data:` event and nothing is
        buffered (the usual read: one token of one stream), consumed as `feed` would; else
        None and nothing consumed (then `feed`). Spares the usual read its event object."""
        if self._plain(chunk) and (self.max_event is None or len(chunk) <= self.max_event):
            return chunk[6:-2]
        return None

    def _plain(self, chunk: bytes) -> bool:
        """Nothing buffered and `chunk` is exactly one plain `data:` event."""
        return (
            not self._buf
            and not self._cr
            and chunk.startswith(b"data: ")
            and chunk.find(b"\n") == len(chunk) - 2
            and chunk.endswith(b"\n\n")
            and b"\r" not in chunk
        )

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        if self._plain(chunk):
            # The usual read: exactly one plain `data:` event (one token of one stream).
            if self.max_event is not None and len(chunk) > self.max_event:
                raise EventTooLarge(f"an SSE event of {len(chunk)} bytes (limit {self.max_event})")
            return [SSEEvent(chunk, chunk[6:-2], True)]
        if self._cr:
            chunk = b"\r" + chunk
            self._cr = False
        if b"\r" in chunk:
            # Rare (our engines and vLLM send LF); normalised chunk by chunk, a trailing CR
            # kept pending since it may be the first half of a CRLF split across reads.
            if chunk.endswith(b"\r"):
                chunk = chunk[:-1]
                self._cr = True
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        buf: bytes | bytearray
        if self._buf:
            scan = len(self._buf) - 1  # a separator may straddle the old and new bytes
            self._buf += chunk
            buf = self._buf
        else:
            scan = 0
            buf = chunk
        events: list[SSEEvent] = []
        start = 0
        limit = self.max_event
        while True:
            end = buf.find(b"\n\n", scan)
            if end < 0:
                break
            if limit is not None and end + 2 - start > limit:
                self._reset()
                raise EventTooLarge(f"an SSE event of {end + 2 - start} bytes (limit {limit})")
            events.append(_parse(bytes(buf[start : end + 2])))
            start = scan = end + 2
        rest = len(buf) - start
        if limit is not None and rest > limit:
            self._reset()
            raise EventTooLarge(f"an SSE event of over {rest} bytes (limit {limit})")
        if buf is self._buf:
            if start:
                del self._buf[:start]
        elif rest:
            self._buf = bytearray(buf[start:])
        return events

    def _reset(self) -> None:
        self._buf = bytearray()
        self._cr = False

    def flush(self) -> list[SSEEvent]:
        """The stream ended: a last event without its blank line still counts."""
        rest = bytes(self._buf).rstrip(b"\r\n")
        self._reset()
        if not rest.strip():
            return []
        return [_parse(rest + b"\n\n")]

    @property
    def pending(self) -> int:
        return len(self._buf)


def _parse(block: bytes) -> SSEEvent:
    # Fast path: the usual event is one `data: ...` line (vLLM, our engines).
    if block.startswith(b"data: ") and block.find(b"\n", 6) == len(block) - 2:
        return SSEEvent(raw=block, data=block[6:-2], plain=True)
    data: list[bytes] = []
    for line in block.split(b"\n"):
        if line.startswith(b"data:"):
            v = line[5:]
            data.append(v[1:] if v.startswith(b" ") else v)
    return SSEEvent(raw=block, data=b"\n".join(data) if data else None)


def encode_data(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


def encode_json(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def encode_comment(text: str = "") -> bytes:
    return b": " + text.encode() + b"\n\n"
