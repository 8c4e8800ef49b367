"""What a cache-aware policy knows of a request's prompt, and where prompts were sent.

The gateway does not tokenize: it cuts the prompt's text into blocks of `block_chars`
characters (64 by default, about 16 tokens: vLLM's block) and names each block by a hash
chained with its parent's, as vLLM names its KV blocks, so that two prompts share a block
name exactly when they share every character up to that block's end. The hash is CRC-32
(zlib, C speed, the same in every process: workers and gateway replicas compute the same
names). A 4,000-token prompt is ~24,000 characters, ~370 blocks, hashed in ~80 µs.

`PrefixIndex` is the approximate index of vllm-router's and SGLang's `cache_aware` policy,
block-hashed instead of a radix tree of characters: per endpoint, the blocks of the prompts
routed there, LRU-bounded (`blocks_per_endpoint`, which should be about what the engine's
KV cache holds). Because a block's name includes its whole prefix, the blocks of one prompt
held by an endpoint form a leading run, and the cached length is found by binary search:
O(log blocks) lookups per candidate. It is approximate both ways: the engine may have
evicted what the index still lists, and it caches the generated text too, which the index
learns only from the next turn's prompt.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from typing import Any

__all__ = [
    "CHARS_PER_TOKEN",
    "MAX_HASHED_BYTES",
    "PrefixIndex",
    "RouteHint",
    "hint_of",
    "prompt_text",
]

# Only a prompt's first this many bytes are named: ~128k tokens, past any model's context,
# and a bound on the CPU one request can cost here (8 MiB bodies are allowed: 8,192 blocks
# instead of 131,072, ~2 ms instead of ~40).
MAX_HASHED_BYTES = 512 * 1024

# For turning characters into an estimate of tokens (English BPE: ~4; the simulator's
# words: ~6 per token including the space, so this over-counts its prefill, uniformly).
CHARS_PER_TOKEN = 4.0


class RouteHint:
    """A request's prompt as block names, its length, and its session key, computed once per
    request; continuations of a stream carry their original's."""

    __slots__ = ("block_chars", "blocks", "chars", "session")

    def __init__(
        self, blocks: list[int], chars: int, session: str | None, block_chars: int
    ) -> None:
        self.blocks = blocks
        self.chars = chars
        self.session = session
        self.block_chars = block_chars


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
    parts: list[str] = []
    for m in raw.get("messages") or ():
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(str(c.get("text", "")) for c in content if isinstance(c, dict))
        parts.append(f"{m.get('role', '')}\n{content or ''}\x1e")
    return "".join(parts)


def hint_of(
    raw: dict[str, Any],
    chat: bool,
    model: str,
    *,
    block_chars: int,
    session: str | None,
) -> RouteHint:
    """Block names of `raw`'s prompt (the model's name is the root: models never share)."""
    data = prompt_text(raw, chat).encode()
    h = zlib.crc32(model.encode())
    blocks: list[int] = []
    add = blocks.append
    crc = zlib.crc32
    for i in range(0, min(len(data), MAX_HASHED_BYTES) - block_chars + 1, block_chars):
        h = crc(data[i : i + block_chars], h)
        add(h)
    if session is None:
        user = raw.get("user")
        session = user if isinstance(user, str) and user else None
    return RouteHint(blocks, len(data), session, block_chars)


class PrefixIndex:
    """Per endpoint, the block names of the prompts routed there (module doc)."""

    __slots__ = ("blocks_per_endpoint", "by_endpoint")

    def __init__(self, blocks_per_endpoint: int = 16384) -> None:
        self.blocks_per_endpoint = blocks_per_endpoint
        self.by_endpoint: dict[str, OrderedDict[int, None]] = {}

    def record(self, endpoint: str, blocks: list[int]) -> None:
        """`blocks` were sent to `endpoint`: most recently used, the oldest evicted. Recorded
        last block first, so a prompt's tail is evicted before its head (as vLLM frees a
        request's blocks) and what stays is still a leading run."""
        if not blocks:
            return
        od = self.by_endpoint.get(endpoint)
        if od is None:
            od = self.by_endpoint[endpoint] = OrderedDict()
        move = od.move_to_end
        for b in reversed(blocks):
            od[b] = None
            move(b)
        over = len(od) - self.blocks_per_endpoint
        pop = od.popitem
        for _ in range(max(0, over)):
            pop(last=False)

    def cached(self, endpoint: str, blocks: list[int]) -> int:
        """How many leading blocks of `blocks` `endpoint` holds (binary search: they form a
        leading run, see the module doc)."""
        od = self.by_endpoint.get(endpoint)
        if not od or not blocks:
            return 0
        if blocks[-1] in od:
            return len(blocks)
        lo, hi = 0, len(blocks) - 1  # blocks[:lo] held; blocks[hi] not
        while lo < hi:
            mid = (lo + hi) // 2
            if blocks[mid] in od:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def forget(self, endpoint: str) -> None:
        self.by_endpoint.pop(endpoint, None)

    def size(self) -> int:
        return sum(len(od) for od in self.by_endpoint.values())
