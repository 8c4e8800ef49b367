"""The fast path's typed decode of the usual vLLM event (`_transform.Transform._fast`): the
msgspec structs of the few fields the accounting reads, their decoders, and `_strip`, which
cuts what the client did not ask for out of the engine's own bytes instead of a re-encode.

Apart from `Transform` so that the struct layout (what the fast path trusts of an event) is
read in one place; `tests/test_relay_events.py` holds this path to the general one.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, UnsetType


class _Usage(msgspec.Struct):
    completion_tokens: int | None = None
    prompt_tokens: int | None = None


class _Delta(msgspec.Struct):
    content: str | None = None
    role: msgspec.Raw | UnsetType = UNSET


class _Choice(msgspec.Struct):
    index: int = 0
    finish_reason: str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: msgspec.Raw | None = None


class _TextChoice(_Choice):
    text: str | None = None


class _ChatChoice(_Choice):
    delta: _Delta | None = None


class _Chunk(msgspec.Struct):
    """The fields of a completion chunk the fast path reads (the rest is skipped, after
    being validated as JSON)."""

    usage: _Usage | None = None
    error: msgspec.Raw | UnsetType = UNSET
    prompt_token_ids: msgspec.Raw | None = None
    id: msgspec.Raw | UnsetType = UNSET
    created: msgspec.Raw | UnsetType = UNSET
    model: msgspec.Raw | UnsetType = UNSET


class _TextChunk(_Chunk):
    choices: list[_TextChoice] | None = None


class _ChatChunk(_Chunk):
    choices: list[_ChatChoice] | None = None


_TEXT = msgspec.json.Decoder(_TextChunk)
_CHAT = msgspec.json.Decoder(_ChatChunk)
_IDS = b'"token_ids":['
_USAGE = b'}],"usage":{'  # the end of `choices`, then usage


def _raw(v: msgspec.Raw | UnsetType) -> Any:
    """A field kept raw, decoded (None when absent, as `dict.get`)."""
    return None if v is UNSET else msgspec.json.decode(v)


def _strip(data: bytes, ids: bool, usage: bool) -> bytes | None:
    """`data` (valid JSON, just decoded) without its top-level `usage` (`usage`) and with
    its one choice's `token_ids` null (`ids`), cut out of the bytes as vLLM lays them out:
    `..."token_ids":[...]}],"usage":{...}}` (the ids the choice's last member, usage the
    chunk's). None for another layout: the caller re-encodes.

    Safe on valid JSON: outside a string, `"token_ids":[` and `,"usage":{` can only be
    those keys (inside one their quotes would be escaped); the ids key must occur once and
    a list of ints holds no `]`; no `}` between the usage key and the last two bytes makes
    usage the top-level object's last member, an object with none inside (the last byte
    then closes the chunk)."""
    if usage:
        i = data.rfind(_USAGE)
        if i < 0 or data.find(b"}", i + 1) != len(data) - 2:
            return None
        if not ids:
            return data[:i] + b"}]}"
        j = data.find(_IDS)
        if j < 0 or data.find(b"]", j) != i - 1 or data.find(_IDS, j + 1, i) >= 0:
            return None
        return data[: j + 12] + b"null}]}"
    j = data.find(_IDS)
    if j < 0 or data.find(_IDS, j + 1) >= 0:
        return None
    return data[: j + 12] + b"null" + data[data.find(b"]", j) + 1 :]
