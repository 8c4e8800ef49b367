"""What a cache-aware policy knows of a request's prompt, and where prompts were sent.

The gateway does not tokenize: it cuts the prompt's text into blocks of `block_chars`
characters (64 by default, about 16 tokens: vLLM's block) and names each block by a hash
chained with its parent's, as vLLM names its KV blocks, so that two prompts share a block
name exactly when they share every character up to that block's end. The hash is CRC-32
(zlib, C speed, the same in every process: workers and gateway replicas compute the same
names). A 4,000-token prompt is ~24,000 characters, ~370 blocks, hashed in ~80 µs.

Names are computed when asked for (`BlockNames`): a pick's binary search reads ~10 of a
long prompt's names, and CRC-32 chains, so a block's name is one `crc32` call over the bytes
from the nearest name known before it (C speed, no Python loop: a candidate that never saw
the prompt costs one 64-byte call). All of them are named only when the chosen replica's
index records the prompt, after the request is on its way to the engine. Measured on a
2,000-token chat, sequential requests through one idle gateway: the work before the engine
got the request fell from ~880 to ~330 µs with the record after the send and names on
demand (docs/performance.md).

`PrefixIndex` is the approximate index of vllm-router's and SGLang's `cache_aware` policy,
block-hashed instead of a radix tree of characters: per endpoint, the blocks of the prompts
routed there, LRU-bounded (`blocks_per_endpoint`, which should be about what the engine's
KV cache holds). Because a block's name includes its whole prefix, the blocks of one prompt
held by an endpoint form a leading run, and the cached length is found by binary search:
O(log blocks) lookups per candidate. It is approximate both ways: the engine may have
evicted what the index still lists, and it caches the generated text too, which the index
learns only from the next turn's prompt. Its storage is a fixed-size `PrefixTable`
(`_prefix_table.py`), which every worker of a gateway shares, so each knows what all of
them sent.
"""

from __future__ import annotations

import zlib
from bisect import bisect_right
from collections.abc import Iterator, Sequence
from typing import Any, overload

import orjson

from unbroken.gateway._prefix_table import MAX_COLUMNS, PrefixTable, table_entries

__all__ = [
    "CHARS_PER_TOKEN",
    "MAX_HASHED_BYTES",
    "BlockNames",
    "PrefixIndex",
    "RouteHint",
    "hint_of",
    "messages_as_chat",
    "prompt_text",
    "responses_as_chat",
]

# Only a prompt's first this many bytes are named: ~128k tokens, past any model's context,
# and a bound on the CPU one request can cost here (8 MiB bodies are allowed: 8,192 blocks
# instead of 131,072, ~2 ms instead of ~40).
MAX_HASHED_BYTES = 512 * 1024

# For turning characters into an estimate of tokens (English BPE: ~4; the simulator's
# words: ~6 per token including the space, so this over-counts its prefill, uniformly).
CHARS_PER_TOKEN = 4.0


class BlockNames(Sequence[int]):
    """The chained CRC-32 names of a prompt's whole blocks, each computed when first asked
    for (module doc): name i is crc32(prompt[: (i + 1) x block_chars], root), taken on from
    the nearest name known below it. Equal, item for item, to the list a loop over the
    blocks makes."""

    __slots__ = ("_all", "_bc", "_data", "_idx", "_n", "_names", "_root")

    def __init__(self, data: bytes, root: int, block_chars: int) -> None:
        self._n = min(len(data), MAX_HASHED_BYTES) // block_chars if block_chars > 0 else 0
        self._data: bytes | None = data
        self._root, self._bc = root, block_chars
        self._idx: list[int] = []  # indices named so far, sorted
        self._names: list[int] = []  # their names
        self._all: list[int] | None = None if self._n else []

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...
    def __getitem__(self, i: int | slice) -> int | list[int]:
        if isinstance(i, slice):
            return self.all()[i]
        if self._all is not None:
            return self._all[i]
        n = self._n
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("block index out of range")
        idx = self._idx
        k = bisect_right(idx, i)
        if k and idx[k - 1] == i:
            return self._names[k - 1]
        start, h = (idx[k - 1] + 1, self._names[k - 1]) if k else (0, self._root)
        bc = self._bc
        assert self._data is not None
        # A view: a long run is not copied (a 64-byte bytes slice is cheaper, in `all`).
        h = zlib.crc32(memoryview(self._data)[start * bc : (i + 1) * bc], h)
        idx.insert(k, i)
        self._names.insert(k, h)
        return h

    def all(self) -> list[int]:
        """Every name, in order (then kept; the prompt's bytes are let go)."""
        if self._all is None:
            assert self._data is not None
            data, bc, h, crc = self._data, self._bc, self._root, zlib.crc32
            out: list[int] = []
            add = out.append
            for i in range(0, self._n * bc, bc):
                h = crc(data[i : i + bc], h)
                add(h)
            self._all, self._data, self._idx, self._names = out, None, [], []
        return self._all

    def __iter__(self) -> Iterator[int]:
        return iter(self.all())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, BlockNames | list | tuple):
            return self.all() == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"BlockNames({self._n} blocks)"


class RouteHint:
    """A request's prompt as block names, its length, and its session key, computed once per
    request; continuations of a stream carry their original's."""

    __slots__ = ("block_chars", "blocks", "cached", "chars", "own_s", "session")

    def __init__(
        self, blocks: Sequence[int], chars: int, session: str | None, block_chars: int
    ) -> None:
        self.blocks = blocks
        self.chars = chars
        self.session = session
        self.block_chars = block_chars
        # Leading blocks the index credited to each candidate scored (by name; a pick's
        # candidates overwrite theirs): what the chosen one held is counted when the leg
        # is admitted.
        self.cached: dict[str, int] = {}
        # What prefilling the part the chosen endpoint was not credited with costs (set by
        # the cache-aware policy at admission): not counted in that leg's first-event time
        # (`EndpointLatency._own`).
        self.own_s = 0.0


def prompt_text(raw: dict[str, Any], chat: bool) -> str:
    """The text an engine prefills for `raw`, up to its template: the prompt, or each
    message's role and content in order (a chat template adds the same framing to the same
    messages, so equal message prefixes stay equal prefixes)."""
    if not chat:
        p = raw.get("prompt")
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            p = p[0]  # several prompts: the first (a batch rarely shares one replica's cache)
        if isinstance(p, str):
            return p
        if isinstance(p, list):  # token ids
            return " ".join(map(str, p))
        return ""
    messages = raw.get("messages")
    if not isinstance(messages, list):
        return ""  # the engine refuses it; routing must not fail first (any JSON may come)
    parts: list[str] = []
    # Tools are rendered into the prompt by the chat template (most put them at its top),
    # so requests that differ only in their tools share no block, and an agent's large
    # tools array is a shared prefix like a system prompt.
    tools = raw.get("tools")
    if isinstance(tools, list) and tools:
        parts.append(f"tools\n{_canonical(tools)}\x1e")
    for m in messages:
        if not isinstance(m, dict):
            continue
        parts.append(f"{m.get('role', '')}\n{_content_text(m.get('content'))}")
        if isinstance(calls := m.get("tool_calls"), list) and calls:
            parts.append(_canonical(calls))
        parts.append("\x1e")
    return "".join(parts)


def _content_text(content: Any) -> str:
    """A message's content as the prefix sees it: text parts joined as vLLM's chat utils
    join them; an image, audio or file part by a digest of what it carries (its URL or
    data), in its place, as vLLM keys a multimodal block by its media's hash: the same text
    with other media shares no block past it."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return "" if content is None else str(content)
    out: list[str] = []
    for c in content:
        if not isinstance(c, dict):
            continue
        kind = c.get("type")
        if kind == "text":
            out.append(str(c.get("text", "")))
        elif kind is not None:
            media = _canonical(c)
            out.append(f"\x1d{kind}:{zlib.crc32(media.encode('utf-8', 'surrogateescape')):08x}")
    return "\n".join(out)


def _canonical(value: Any) -> str:
    """A JSON value as stable text (keys sorted), for what is hashed and not read."""
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()
    except TypeError:  # not JSON (cannot come from a parsed body): still deterministic
        return repr(value)


def responses_as_chat(raw: dict[str, Any]) -> dict[str, Any]:
    """A Responses API request's conversation as chat messages (`instructions` first, as the
    system message vLLM renders it as; each input item's role and text), so that its turns
    name blocks as a chat conversation's do and route by prefix and session the same way."""
    msgs: list[dict[str, Any]] = []
    if isinstance(ins := raw.get("instructions"), str) and ins:
        msgs.append({"role": "system", "content": ins})
    inp = raw.get("input")
    if isinstance(inp, str):
        msgs.append({"role": "user", "content": inp})
    elif isinstance(inp, list):
        for item in inp:
            if not isinstance(item, dict):
                continue
            kind = item.get("type", "message")
            if kind == "message" or "role" in item:
                content = item.get("content")
                if isinstance(content, list):  # input_text / output_text parts
                    content = "\n".join(
                        str(c.get("text", "")) for c in content if isinstance(c, dict)
                    )
                msgs.append({"role": item.get("role", "user"), "content": content})
            elif kind == "function_call":
                call = f"{item.get('name', '')}{item.get('arguments', '')}"
                msgs.append({"role": "assistant", "content": call})
            elif kind == "function_call_output":
                msgs.append({"role": "tool", "content": str(item.get("output", ""))})
    return {
        "messages": msgs,
        "tools": raw.get("tools"),
        "prompt_cache_key": raw.get("prompt_cache_key"),
        "user": raw.get("user"),
        "cache_salt": raw.get("cache_salt"),
    }


def _blocks_text(content: Any) -> Any:
    """An Anthropic message's content as chat's: its blocks in order, a tool call (its name
    and input) and a tool result (its content) as text parts; text, images and documents as
    they are, which chat's reader (`_content_text`) takes as it takes chat's parts. A string
    passes as is."""
    if not isinstance(content, list):
        return content
    out: list[Any] = []
    for b in content:
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "tool_use":
            out.append({"type": "text", "text": f"{b.get('name', '')}{b.get('input', '')}"})
        elif kind == "tool_result":
            out.append({"type": "text", "text": _content_text(_blocks_text(b.get("content")))})
        else:
            out.append(b)
    return out


def messages_as_chat(raw: dict[str, Any]) -> dict[str, Any]:
    """An Anthropic Messages API request (`/v1/messages`, which vLLM 0.32 serves) as chat
    messages: `system` first, then each message's role and the text of its blocks, so that an
    agent's growing conversation (a long system prompt and tool results: the most
    prefix-heavy traffic there is) routes by prefix and session as a chat conversation does;
    `metadata.user_id` names the session as chat's `user`."""
    msgs: list[dict[str, Any]] = []
    system = _content_text(_blocks_text(raw.get("system")))
    if system:
        msgs.append({"role": "system", "content": system})
    given = raw.get("messages")
    for m in given if isinstance(given, list) else ():
        if isinstance(m, dict):
            msgs.append({"role": m.get("role", "user"), "content": _blocks_text(m.get("content"))})
    meta = raw.get("metadata")
    return {
        "messages": msgs,
        "tools": raw.get("tools"),
        "user": meta.get("user_id") if isinstance(meta, dict) else None,
    }


def session_of(raw: dict[str, Any]) -> str | None:
    """A request body's conversation key: OpenAI's `prompt_cache_key` (which its client
    recommends over `user` "to maintain caching optimizations"), else `user`."""
    for field in ("prompt_cache_key", "user"):
        v = raw.get(field)
        if isinstance(v, str) and v:
            return v
    return None


def hint_of(
    raw: dict[str, Any],
    chat: bool,
    model: str,
    *,
    block_chars: int,
    session: str | None,
    user_header: str | None = None,
) -> RouteHint:
    """Block names of `raw`'s prompt (the model's name is the root: models never share;
    a `cache_salt` is folded into it, as vLLM keys a salted prompt's first block by it).
    The session: `session` (the session header's), else the body's (`session_of`), else
    `user_header` (an `X-User-ID`, vllm-router's second key)."""
    data = prompt_text(raw, chat).encode()
    root = zlib.crc32(model.encode())
    salt = raw.get("cache_salt")
    if isinstance(salt, str) and salt:
        root = zlib.crc32(b"\x00cache_salt\x00" + salt.encode("utf-8", "surrogateescape"), root)
    blocks = BlockNames(data, root, block_chars)
    if session is None:
        session = session_of(raw) or user_header
    return RouteHint(blocks, len(data), session, block_chars)


class PrefixIndex:
    """Per endpoint, the block names of the prompts routed there (module doc), kept in a
    `PrefixTable`: this process's own (anonymous memory), or the one every worker of the
    gateway maps (`shared`), whose columns are the admission table's endpoint columns."""

    __slots__ = ("_cols", "_free", "blocks_per_endpoint", "shared", "table")

    def __init__(self, blocks_per_endpoint: int = 16384, table: PrefixTable | None = None) -> None:
        self.blocks_per_endpoint = blocks_per_endpoint
        self.shared = table is not None
        self.table = table if table is not None else PrefixTable(table_entries(blocks_per_endpoint))
        self._cols: dict[str, int] = {}  # own table: endpoint -> column
        self._free = list(range(MAX_COLUMNS - 1, -1, -1))

    def _col(self, endpoint: str, col: int | None, new: bool) -> int | None:
        """The table column of `endpoint`. Shared: `col`, the one the main process gave it
        (None: not known, nothing recorded). Own table: assigned here on its first record."""
        if self.shared:
            return col
        c = self._cols.get(endpoint)
        if c is None and new and self._free:
            c = self._cols[endpoint] = self._free.pop()
        return c

    def record(self, endpoint: str, blocks: Sequence[int], col: int | None = None) -> None:
        """`blocks` were sent to `endpoint`: most recently used, each endpoint's oldest
        beyond `blocks_per_endpoint` no longer counted. Stamped head newest, so a prompt's
        tail ages before its head (as vLLM frees a request's blocks) and what counts is
        still a leading run."""
        c = self._col(endpoint, col, True) if blocks else None
        if c is not None:
            self.table.record(c, blocks[: self.blocks_per_endpoint], self.blocks_per_endpoint)

    def cached(self, endpoint: str, blocks: Sequence[int], col: int | None = None) -> int:
        """How many leading blocks of `blocks` `endpoint` holds (binary search: they form a
        leading run, see the module doc)."""
        c = self._col(endpoint, col, False)
        return 0 if c is None else self.table.cached(c, blocks, self.blocks_per_endpoint)

    def forget(self, endpoint: str) -> None:
        """`endpoint` is gone. Own table: its column is cleared and free again. Shared: the
        main process clears a column when it gives it to another endpoint (a worker's
        forget could race a record of the new one)."""
        c = self._cols.pop(endpoint, None)
        if c is not None:
            self.table.clear(c)
            self._free.append(c)

    def size(self, col: int | None = None) -> int:
        """Blocks that count: in column `col`, or in all (a scan of the table: tests)."""
        return self.table.live(self.blocks_per_endpoint, col)
