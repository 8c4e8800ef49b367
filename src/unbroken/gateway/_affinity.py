"""Cache- and session-aware routing: the latency-aware policy plus what each candidate holds.

One decision, not a cascade of thresholds: a candidate's expected first-token time is the
latency policy's (queue and decode, `_latency`) plus the prefill of the part of this prompt
it does not hold, and candidates are ranked by `(load + 1) x that`, so cache affinity and
load trade off continuously. What a candidate holds:

- **Prefix** (`PrefixIndex`): the leading blocks of this prompt that were routed there, by
  any worker of this gateway (the index's table is shared by them, `_prefix_table.py`).
- **Session**: a request with a session key (the `session_header`, else the body's
  `prompt_cache_key`, else its `user`) credits its whole prompt (`session`; under `prefix`
  its first `session_blocks` blocks, a prior) to the key's home: the candidate with the
  highest rendezvous hash of (key, endpoint), while it has room (in flight under the bound
  `mean x (1 + balance_rel) + session_slack`, counting this request; no request queued in
  its engine; its KV cache under `session_kv_room` full). Under `session` such a home is
  chosen while its expected first token is within `session_time_ratio` x the soonest
  candidate's, however the loads compare (the score's `(load + 1)` factor alone sent short
  turns away from a home with a stream or two more than its neighbours). Rendezvous
  hashing is consistent: adding or removing a replica moves only the sessions whose home
  it is, and every gateway worker and replica computes the same home without sharing
  state.
- **A new prefix** (no candidate holds any of it, no session): its first block's home gets
  credit for its first `home_blocks` blocks, a small prior that breaks near-ties the same
  way in every worker and gateway replica, so the first requests of a new system prompt
  converge on one replica instead of one per worker.

Hot spots (one popular prefix piling onto one replica): a candidate whose load exceeds the
least-loaded candidate's by more than `balance_rel` x it + `balance_abs` gets no credit at
all (bounded-load affinity), so it is chosen for its load alone until the others catch up.

A continuation (a pick that excludes where the stream was) is scored the same way: it
prefers a replica that holds its prompt's prefix. A draining replica is no candidate, so its
cached prefixes stop attracting requests; a new replica holds nothing and wins on load.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from unbroken.gateway._latency import LatencyAware, LatencySettings
from unbroken.gateway._prefix import CHARS_PER_TOKEN, PrefixIndex

if TYPE_CHECKING:
    from unbroken.gateway._pool import Endpoint, PickRequest
    from unbroken.gateway._prefix_share import PrefixShare
    from unbroken.gateway._prefix_table import PrefixTable

__all__ = ["AffinitySettings", "CacheAware", "home"]


@dataclass(frozen=True)
class AffinitySettings:
    """The cache-aware policy's knobs (docs/gateway.md, "Routing")."""

    use_prefix: bool = True  # the prefix index (off: session affinity only)
    use_session: bool = True
    prefill_s_per_token: float = 40e-6  # what an uncached prompt token costs to prefill
    blocks_per_endpoint: int = 16384  # index bound per endpoint (~ its KV cache, in blocks)
    home_blocks: int = 4  # a new prefix's home is credited with this many leading blocks
    # What a session's home is credited with: None, the whole prompt (the `session` policy:
    # the conversation lives there); a number, at most that many blocks: a prior that breaks
    # near-ties, so the prefix index (where the history really is) keeps a conversation
    # and load places a new one (`prefix`).
    session_blocks: int | None = None
    balance_abs: float = 8.0  # no credit above min load x (1 + balance_rel) + balance_abs
    balance_rel: float = 0.25
    # A session's home has room only while its engine queues nothing and its KV cache
    # (vllm:kv_cache_usage_perc, the blocks running requests hold) is below this share.
    session_kv_room: float = 0.9
    # A session's home has room while its in-flight is under the candidates' mean (counting
    # this request) x (1 + balance_rel) + this: one stream above its share, so that at low
    # concurrency a home with a stream open is not "full" (without it, one stream of three
    # replicas made every home full), and at high concurrency the bound is the share.
    session_slack: float = 1.0
    # `session`: a home with room is chosen while its expected first token (queue, decode
    # and the prefill of what it does not hold) is within this many times the soonest
    # candidate's, however loads compare: `(load + 1) x expected` alone sent short turns
    # from a home with one more stream than its neighbours elsewhere. None: cost decides.
    session_time_ratio: float | None = 1.5


_M64 = (1 << 64) - 1


def _weight(k: int, name: str) -> int:
    """Rendezvous weight of a key (its CRC-32) on an endpoint: splitmix64's finalizer over
    both CRCs. Rendezvous hashing needs weights independent across endpoints; a CRC alone
    is affine over GF(2), so crc32(name, crc32(key)) of same-length names (pod IPs, ports)
    differed by a constant XOR per endpoint and the argmax read a few bits: with three
    replicas one was home to half of all keys (0.50 / 0.25 / 0.25; a helper's review)."""
    x = (k << 32) | zlib.crc32(name.encode())
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def home(key: bytes, candidates: Sequence[Endpoint]) -> Endpoint | None:
    """The rendezvous (highest random weight) choice of `key` among `candidates`: the same
    in every worker and gateway replica, and removing a candidate moves only its keys."""
    best: Endpoint | None = None
    best_w = -1
    k = zlib.crc32(key)
    for e in candidates:
        w = _weight(k, e.name)
        if w > best_w:
            best, best_w = e, w
    return best


class CacheAware(LatencyAware):
    """`prefix` and `session` routing (module doc)."""

    wants_hint = True  # the proxy computes each request's `RouteHint` for it

    def __init__(
        self,
        settings: LatencySettings | None = None,
        affinity: AffinitySettings | None = None,
        table: PrefixTable | None = None,
    ) -> None:
        """`table`: the gateway's shared prefix table (workers); None: this process's own."""
        super().__init__(settings)
        self.a = affinity or AffinitySettings()
        self.index = PrefixIndex(self.a.blocks_per_endpoint, table)
        self.lookup_blocks = 0  # blocks of admitted prompts
        self.hit_blocks = 0  # of those, the leading run the index credited where they went
        # Other gateway replicas told of each record (`_prefix_share.PrefixShare`), or None.
        self.share: PrefixShare | None = None

    def _col(self, e: Endpoint) -> int | None:
        """`e`'s column in a shared table: its admission column (`_shared.SharedSlot`),
        which the main process gives each endpoint and clears in the prefix table when it
        gives it to another."""
        return getattr(e.slot, "col", None) if self.index.shared else None

    def _held(
        self, candidates: Sequence[Endpoint], request: PickRequest
    ) -> tuple[list[int], int | None]:
        """Per candidate, the characters of the prompt credited to it; and which of them is
        the session's home, while it keeps its credit (None: no such home)."""
        hint = request.hint
        n = len(candidates)
        if hint is None:
            return [0] * n, None
        blocks, bc = hint.blocks, hint.block_chars
        if self.a.use_prefix:
            cached, col = self.index.cached, self._col
            found = [cached(e.name, blocks, col(e)) for e in candidates]
            # Updated, not replaced: `pick_route` scores the first pool, then later ones,
            # and keeps the first's choice when nothing spills; the chosen endpoint is
            # always among the candidates of this pick, so its entry is this pick's.
            hint.cached.update(zip((e.name for e in candidates), found, strict=True))
            held = [k * bc for k in found]
        else:
            held = [0] * n
        home_i: int | None = None
        if self.a.use_session and hint.session:
            # A header's undecodable bytes arrive as surrogates: hash the bytes as sent.
            h = home(hint.session.encode("utf-8", "surrogateescape"), candidates)
            # Consistent hashing with bounded loads (Mirrokni et al.): a home already running
            # more than (1 + balance_rel) x the mean in-flight of the candidates (counting
            # this request) gets no credit, so hashing's uneven share of sessions does not
            # become one replica's queue; the overflow goes where it costs least. Nor does a
            # home without room in its KV cache: long conversations fill it well before
            # their count reaches the bound, and then the engine queues or preempts.
            if (
                h is not None
                and h.inflight + h.foreign < self._session_bound(candidates)
                and h.waiting <= 0
                and h.kv_usage < self.a.session_kv_room
            ):
                i = home_i = candidates.index(h)
                sb = self.a.session_blocks
                credit = hint.chars if sb is None else min(hint.chars, sb * bc)
                held[i] = max(held[i], credit)  # the conversation lives there
        elif self.a.use_prefix and blocks and not any(held):
            h = home(blocks[0].to_bytes(4, "little"), candidates)
            if h is not None:
                held[candidates.index(h)] = min(len(blocks), self.a.home_blocks) * bc
        if any(held):
            lo = min(e.load for e in candidates)
            limit = lo * (1.0 + self.a.balance_rel) + self.a.balance_abs
            for i, e in enumerate(candidates):
                if held[i] and e.load > limit:
                    held[i] = 0
        return held, (home_i if home_i is not None and held[home_i] else None)

    def _session_bound(self, candidates: Sequence[Endpoint]) -> float:
        """In flight a session's home may carry: the mean with this request, with relative
        and absolute slack (without the absolute part, one open stream of three replicas
        made every home full: a conversation moved at almost every turn; a review's).
        Counted with what other gateway replicas hold there (`Endpoint.foreign`), so that
        the replicas agree on which homes are full."""
        mean = (sum(e.inflight + e.foreign for e in candidates) + 1) / len(candidates)
        return mean * (1.0 + self.a.balance_rel) + self.a.session_slack

    def _best(
        self,
        candidates: Sequence[Endpoint],
        now: float,
        prior: float | None,
        request: PickRequest,
    ) -> tuple[Endpoint | None, float | None, float]:
        """`session`: the key's home while it has room and expects a first token within
        `session_time_ratio` x the soonest candidate's, whatever the loads (module doc);
        otherwise, and under `prefix`, the lowest `(load + 1) x expected`."""
        hint = request.hint
        ratio = self.a.session_time_ratio
        if (
            not candidates
            or hint is None
            or not hint.session
            or not self.a.use_session
            or self.a.session_blocks is not None
            or ratio is None
        ):
            return super()._best(candidates, now, prior, request)
        costs, home_i = self._scored(candidates, now, prior, request)
        i = self._lowest(candidates, costs)
        if home_i is not None and home_i != i:
            t_home, t_best = costs[home_i][0], costs[i][0]
            if t_home is not None and t_best is not None and t_home <= ratio * t_best:
                i = home_i
        return candidates[i], costs[i][0], costs[i][1]

    def _costs(
        self, candidates: Sequence[Endpoint], now: float, prior: float | None, request: PickRequest
    ) -> list[tuple[float | None, float]]:
        return self._scored(candidates, now, prior, request)[0]

    def _scored(
        self, candidates: Sequence[Endpoint], now: float, prior: float | None, request: PickRequest
    ) -> tuple[list[tuple[float | None, float]], int | None]:
        """`_costs`, and the index of the session's home with credit (`_held`)."""
        hint = request.hint
        if hint is None:
            return super()._costs(candidates, now, prior, request), None
        # A floor of one token: a credited candidate wins an exact tie even for a short prompt.
        per_token = self.a.prefill_s_per_token
        out: list[tuple[float | None, float]] = []
        held, home_i = self._held(candidates, request)
        for e, h in zip(candidates, held, strict=True):
            exp = e.latency.expected(now, prior, self.s)
            uncached = (max(0, hint.chars - h) + (0 if h else CHARS_PER_TOKEN)) / CHARS_PER_TOKEN
            total = (exp if exp is not None else self.s.floor_s) + uncached * per_token
            out.append((total, (e.load + 1.0) * total))
        return out, home_i

    def on_admit(self, ep: Endpoint, request: PickRequest) -> None:
        hint = request.hint
        if hint is not None and self.a.use_prefix:
            # What the index believed the chosen replica held of this prompt, against what
            # was looked up: the gateway's own estimate of the prefix hit rate
            # (`unbroken_gateway_prefix_*_blocks_total`), to set beside the engines'
            # vllm:prefix_cache_hits_total / _queries_total.
            held = hint.cached.get(ep.name, 0)
            self.lookup_blocks += len(hint.blocks)
            self.hit_blocks += held
            uncached = max(0, hint.chars - held * hint.block_chars) / CHARS_PER_TOKEN
            hint.own_s = uncached * self.a.prefill_s_per_token
            self.index.record(ep.name, hint.blocks, self._col(ep))
            if self.share is not None:
                self.share.publish(ep.name, hint.blocks)

    def learn(self, ep: Endpoint, blocks: Sequence[int]) -> None:
        """Another gateway replica sent `blocks` to `ep` (`_prefix_share`): recorded as if
        sent from here."""
        if self.a.use_prefix:
            self.index.record(ep.name, blocks, self._col(ep))

    def forget(self, name: str) -> None:
        self.index.forget(name)
