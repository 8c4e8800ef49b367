"""The KV cache as vLLM v1 manages it: fixed-size blocks, ref-counted, with automatic prefix
caching (vllm/v1/core/block_pool.py and kv_cache_manager.py, one KV-cache group).

A full block is named by a hash chained over its parent's hash and its token ids, so two
prompts that share a prefix share its blocks. Blocks no running sequence references stay
cached in a free queue in eviction order (least recently freed first; a sequence's tail
blocks before its head) and are evicted only when an allocation pops them. As in vLLM,
cached-but-unreferenced blocks count as free: `usage` is what running sequences hold.

Only timing depends on this: the text is a function of the context alone. With `events`
on, the cache records vLLM's KV events as it goes (`kvevents.py`: BlockStored when a step's
full blocks are registered, BlockRemoved when a cached block is evicted, AllBlocksCleared on
a reset), for the engine to publish once a step.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Protocol

from unbroken.engine.kvevents import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    external_hash,
)

__all__ = ["Block", "CacheUser", "KVCache", "root_hash", "salted_root"]


def root_hash(model: str) -> int:
    """The parent of a prompt's first block: the served model's name, so different models (or
    LoRA adapters served under their own names) never share blocks. Stable across processes."""
    return int.from_bytes(hashlib.blake2b(model.encode(), digest_size=8).digest(), "little")


def salted_root(root: int, salt: str) -> int:
    """The parent of a salted prompt's first block: vLLM adds a request's `cache_salt` to its
    first block's extra keys (v1/core/kv_cache_utils.py), so prompts under different salts
    (or none) never share a block, and every block after the first inherits it by chain."""
    h = hashlib.blake2b(salt.encode(), digest_size=8, key=root.to_bytes(8, "little"))
    return int.from_bytes(h.digest(), "little")


class Block:
    __slots__ = ("hash", "id", "ref")

    def __init__(self, block_id: int) -> None:
        self.id = block_id
        self.ref = 0
        self.hash: int | None = None  # set once the block is full and registered


class CacheUser(Protocol):
    """What the cache needs of a sequence (core.Seq)."""

    token_ids: list[int]
    block_hashes: list[int]
    blocks: list[Block]
    num_cached_blocks: int


class KVCache:
    """A pool of `num_blocks` blocks of `block_size` tokens. All calls come from the engine
    thread. `queries` / `hits` are in tokens (vLLM's prefix_cache_queries / _hits)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_caching: bool = True,
        root: int = 0,
        events: bool = False,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV cache needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.root = root
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order (front first), keyed by block id for O(1) removal.
        self.free: OrderedDict[int, Block] = OrderedDict((b.id, b) for b in self.blocks)
        self.cached: dict[int, Block] = {}  # block hash -> the block holding it
        self.queries = 0
        self.hits = 0
        self.evictions = 0
        # vLLM's KV events since the last `take_events` (None: not recorded).
        self.events: list[BlockStored | BlockRemoved | AllBlocksCleared] | None = (
            [] if events else None
        )

    # -- reading --------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """vLLM's BlockPool.get_usage: 1 - free / total; cached-unreferenced blocks are free."""
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- hashing --------------------------------------------------------------------------
    def _hash_upto(self, s: CacheUser, num_blocks: int) -> list[int]:
        """Extend `s.block_hashes` to its first `num_blocks` full blocks (kept across
        preemptions, as vLLM keeps a request's block hashes)."""
        hashes = s.block_hashes
        bs = self.block_size
        ids = s.token_ids
        parent = hashes[-1] if hashes else (getattr(s, "cache_root", 0) or self.root)
        for i in range(len(hashes), num_blocks):
            parent = hash((parent, tuple(ids[i * bs : (i + 1) * bs])))
            hashes.append(parent)
        return hashes

    # -- the engine's calls ---------------------------------------------------------------
    def lookup(self, s: CacheUser, num_tokens: int) -> list[Block]:
        """The longest run of cached blocks at the start of `s`'s first `num_tokens` tokens,
        leaving at least the last token to compute (vLLM: max_cache_hit_length = n - 1)."""
        if not self.enable_caching or len(s.token_ids) < num_tokens:
            return []
        hashes = self._hash_upto(s, (num_tokens - 1) // self.block_size)
        hit: list[Block] = []
        cached = self.cached
        for h in hashes[: (num_tokens - 1) // self.block_size]:
            b = cached.get(h)
            if b is None:
                break
            hit.append(b)
        return hit

    def can_admit(self, hit: list[Block], num_blocks: int) -> bool:
        """Whether `num_blocks` blocks, starting with the hit, fit: the new ones and the hit
        blocks nobody references come out of the free queue (vLLM's allocate_slots check)."""
        evictable = sum(1 for b in hit if b.ref == 0)
        return num_blocks - len(hit) + evictable <= len(self.free)

    def admit(self, s: CacheUser, hit: list[Block], num_blocks: int) -> None:
        """Give a waiting sequence its blocks: the hit ones (touched first, so this very
        allocation cannot evict them), then new ones from the free queue."""
        free = self.free
        for b in hit:
            if b.ref == 0:
                del free[b.id]
            b.ref += 1
        s.blocks = hit + self._take(num_blocks - len(hit))
        s.num_cached_blocks = len(hit)

    def grow(self, s: CacheUser, num_blocks: int) -> None:
        """Allocate blocks until `s` holds `num_blocks` (a decode crossing a block boundary)."""
        if num_blocks > len(s.blocks):
            s.blocks.extend(self._take(num_blocks - len(s.blocks)))

    def _take(self, n: int) -> list[Block]:
        out = []
        free = self.free
        cached = self.cached
        for _ in range(n):
            _, b = free.popitem(last=False)
            if b.hash is not None:  # the least recently freed cached block: evict it
                if cached.get(b.hash) is b:
                    del cached[b.hash]
                    if self.events is not None:
                        self.events.append(
                            BlockRemoved(
                                block_hashes=[external_hash(b.hash)], medium=MEDIUM_GPU, group_idx=0
                            )
                        )
                b.hash = None
                self.evictions += 1
            b.ref = 1
            out.append(b)
        return out

    def cache_full(self, s: CacheUser, num_tokens: int) -> None:
        """Register the full blocks among `s`'s first `num_tokens` tokens (those whose KV this
        step computes). A block whose content is already cached elsewhere stays unnamed: the
        first copy is the one found (vLLM keeps both, and finds the first too)."""
        if not self.enable_caching:
            return
        full = min(num_tokens, len(s.token_ids)) // self.block_size
        if full <= s.num_cached_blocks:
            return
        hashes = self._hash_upto(s, full)
        cached = self.cached
        first = s.num_cached_blocks
        for i in range(first, full):
            h = hashes[i]
            if h not in cached:
                b = s.blocks[i]
                b.hash = h
                cached[h] = b
        s.num_cached_blocks = full
        if self.events is not None:
            self.events.append(self._stored(s, hashes, first, full))

    def _stored(self, s: CacheUser, hashes: list[int], first: int, end: int) -> BlockStored:
        """vLLM's event for blocks `first`..`end` of `s` (block_pool.cache_full_blocks: every
        new full block, a copy of content cached elsewhere included, as vLLM stores both).
        `s.lora`, `s.lora_id` and `s.cache_salt`, where it has them (core.Seq), go into the
        event as vLLM puts a request's adapter and salt."""
        bs = self.block_size
        lora = getattr(s, "lora", None)
        salt = getattr(s, "cache_salt", None)
        extra: list[tuple[str, ...] | None] = []
        for i in range(first, end):
            keys = ((lora,) if lora else ()) + ((salt,) if salt and i == 0 else ())
            extra.append(keys or None)
        return BlockStored(
            block_hashes=[external_hash(h) for h in hashes[first:end]],
            parent_block_hash=external_hash(hashes[first - 1]) if first else None,
            token_ids=s.token_ids[first * bs : end * bs],
            block_size=bs,
            lora_id=getattr(s, "lora_id", None) if lora else None,
            medium=MEDIUM_GPU,
            lora_name=lora,
            extra_keys=extra,
            group_idx=0,
            # vLLM's KVCacheManager.take_events annotates every stored event with its
            # group's kind: one group of plain decoder attention here.
            kv_cache_spec_kind="full_attention",
        )

    def take_events(self) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
        """The events recorded since the last call (empty when not recording)."""
        ev = self.events
        if not ev:
            return []
        self.events = []
        return ev

    def reset(self) -> bool:
        """vLLM's BlockPool.reset_prefix_cache: forget every cached block, only while no
        sequence holds one (False otherwise)."""
        if len(self.free) != self.num_blocks:
            return False
        self.cached.clear()
        for b in self.blocks:
            b.hash = None
        if self.events is not None:
            self.events.append(AllBlocksCleared())
        return True

    def release(self, s: CacheUser) -> None:
        """Drop `s`'s references (finish, abort or preemption). Blocks nobody holds go to the
        free queue's tail, last block first, so a sequence's tail is evicted before its
        head (the head is what other prompts share)."""
        free = self.free
        for b in reversed(s.blocks):
            b.ref -= 1
            if b.ref == 0:
                free[b.id] = b
        s.blocks = []
        s.num_cached_blocks = 0

    def record(self, num_tokens: int, hit_blocks: int) -> None:
        """vLLM's PrefixCacheStats for a new request (re-admissions after a preemption are
        kept apart by vLLM and not exported, so they are not counted here)."""
        if self.enable_caching:
            self.queries += num_tokens
            self.hits += hit_blocks * self.block_size

    def check(self, holders: list[CacheUser]) -> None:
        """Assert the pool's invariants against the sequences holding blocks (tests)."""
        refs: dict[int, int] = {}
        for s in holders:
            for b in s.blocks:
                refs[b.id] = refs.get(b.id, 0) + 1
        for b in self.blocks:
            assert b.ref == refs.get(b.id, 0), (b.id, b.ref, refs.get(b.id, 0))
            assert (b.id in self.free) == (b.ref == 0), b.id
        assert len(refs) + len(self.free) == self.num_blocks
        for h, b in self.cached.items():
            assert b.hash == h
