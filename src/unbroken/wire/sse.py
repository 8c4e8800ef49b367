"""Server-sent events: an incremental decoder with no I/O, and the encoder.

The decoder is fed raw bytes as they arrive (`iter_any()`), keeps its own line buffer so no
line-length limit of the transport applies, and returns complete events. Each event keeps its
raw bytes so a relay can forward it untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

__all__ = ["DONE", "SSEDecoder", "SSEEvent", "encode_comment", "encode_data", "encode_json"]

DONE = b"[DONE]"


@dataclass(slots=True)
class SSEEvent:
    raw: bytes  # the event as received, terminator included
    data: bytes | None  # joined `data:` lines, None for comment-only events

    @property
    def is_done(self) -> bool:
        return self.data == DONE

    def json(self) -> Any:
        return orjson.loads(self.data) if self.data is not None else None


class SSEDecoder:
    """Splits a byte stream into SSE events. Handles LF, CRLF and CR line ends and any split
    of the stream across `feed` calls."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        buf = self._buf + chunk if self._buf else chunk
        if b"\r" in buf:
            # Rare (our engines and vLLM send LF); normalise, keeping a trailing CR pending
            # since it may be the first half of a CRLF split across reads.
            keep = buf.endswith(b"\r")
            core = buf[:-1] if keep else buf
            buf = core.replace(b"\r\n", b"\n").replace(b"\r", b"\n") + (b"\r" if keep else b"")
        events: list[SSEEvent] = []
        start = 0
        while True:
            end = buf.find(b"\n\n", start)
            if end < 0:
                break
            block = buf[start : end + 2]
            events.append(_parse(block))
            start = end + 2
        self._buf = buf[start:]
        return events

    def flush(self) -> list[SSEEvent]:
        """The stream ended: a last event without its blank line still counts."""
        rest, self._buf = self._buf.rstrip(b"\r\n"), b""
        if not rest.strip():
            return []
        return [_parse(rest + b"\n\n")]

    @property
    def pending(self) -> int:
        return len(self._buf)


def _parse(block: bytes) -> SSEEvent:
    # Fast path: the usual event is one `data: ...` line (vLLM, our engines).
    if block.startswith(b"data: ") and block.find(b"\n", 6) == len(block) - 2:
        return SSEEvent(raw=block, data=block[6:-2])
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
