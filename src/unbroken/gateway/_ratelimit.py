"""Per-tenant limits (issue 25): requests, prompt and completion tokens per minute, and
concurrent streams, enforced at admission, exact across the gateway's workers and, with
`rate_limit.store: redis`, across its replicas (docs/gateway.md, "Tenants").

Each per-minute limit L is a token bucket: it holds L, refills at L/60 per second, and a
request takes what it uses. Stored as the *level used* (0 = full bucket), which drains at
L/60 per second, and the time it was last written. A request is admitted when every
bucket of its tenant holds at least one unit (`level + 1 <= L`); the request bucket takes
its one at once, the token buckets take the tokens as the engine reports them (usage), so
one long answer may drive a token level past L, and the tenant's next requests wait until it
has drained again. A stream in progress is never cut. A request whose max_tokens x n exceeds
its whole completion-token limit L could never be served in full: refused at once
(`TooLarge`, OpenAI's "Request too large"), without a Retry-After. This is what OpenAI's
headers describe: `remaining` is what the bucket holds now, `reset` when it is full again.

Where the levels live:
- `TenantTable` (`_tenant_table.py`): one shared-memory file for all workers of a gateway,
  checked and taken under one lock.
- `RedisStore` (`_ratelimit_redis.py`): the same buckets in Redis, one round trip per
  admission, shared by every replica.

The local table is always kept (this replica's own usage). With no store, or while Redis is
unreachable, each replica enforces its share of every limit (`cap_share`, as the caps).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from unbroken.gateway._ratelimit_redis import TIMEOUTS_DOWN, RedisStore
from unbroken.gateway._tenant_table import KINDS, LIMIT_KEYS, MAX_TENANTS, TenantTable
from unbroken.wire.errors import ApiError

if TYPE_CHECKING:
    from unbroken.config.tenants import RateLimitSettings, TenantSpec

__all__ = [
    "KINDS",
    "LIMIT_KEYS",
    "MAX_TENANTS",
    "REASONS",
    "TIMEOUTS_DOWN",
    "Lease",
    "Limiter",
    "RateLimited",
    "RedisStore",
    "TenantTable",
    "TooLarge",
    "cap_share",
    "reset_text",
]

# Why a request was refused (the rejections metric's `reason`).
REASONS = (*LIMIT_KEYS, "concurrent_streams")


def cap_share(total: int, replicas: int, rank: int) -> int:
    """This replica's part of `total` (as `_discovery.cap_share`): parts add up to `total`."""
    replicas = max(1, replicas)
    return max(1, total // replicas + (1 if rank < total % replicas else 0))


def reset_text(seconds: float) -> str:
    """OpenAI's duration form for the `x-ratelimit-reset-*` headers, Go's `time.Duration`
    text: `20ms`, `1s`, `8.64s`, `6m0s`, `1m1.5s`, `2h1m0.4s`. Rounded up to the
    millisecond, so that a client that waits as long is not refused again."""
    if seconds <= 0:
        return "0s"
    ms = max(1, math.ceil(seconds * 1000 - 1e-6))
    if ms < 1000:
        return f"{ms}ms"
    h, rem = divmod(ms, 3_600_000)
    m, rem = divmod(rem, 60_000)
    s = f"{rem / 1000:.3f}".rstrip("0").rstrip(".")
    if h:
        return f"{h}h{m}m{s}s"
    return f"{m}m{s}s" if m else f"{s}s"


_WHAT = {
    "requests_per_minute": "requests per min (RPM)",
    "prompt_tokens_per_minute": "prompt tokens per min",
    "completion_tokens_per_minute": "completion tokens per min",
    "concurrent_streams": "concurrent streams",
}


class RateLimited(ApiError):
    """429 for a tenant over one of its limits, in OpenAI's form (type `requests` or
    `tokens`, code `rate_limit_exceeded`), with Retry-After and the x-ratelimit headers."""

    def __init__(
        self, tenant: str, reason: str, limit: int, retry_s: float, hdrs: dict[str, str]
    ) -> None:
        retry_s = max(retry_s, 0.001)
        if reason == "concurrent_streams":
            after = "Please try again when one of its requests has finished."
        else:
            wait = f"{retry_s:.3g}s" if retry_s < 60 else reset_text(retry_s)
            after = f"Please try again in {wait}."
        super().__init__(
            429,
            f"Rate limit reached for tenant {tenant} on {_WHAT[reason]}: Limit {limit}. {after}",
            type="tokens" if "tokens" in reason else "requests",
            code="rate_limit_exceeded",
            headers={
                **hdrs,
                "Retry-After": str(max(1, math.ceil(retry_s))),
                "retry-after-ms": str(max(1, math.ceil(retry_s * 1000))),
            },
        )
        self.reason = reason


class TooLarge(RateLimited):
    """429 for a request whose `max_tokens` x `n` exceeds its tenant's completion tokens per
    minute, as OpenAI's "Request too large": waiting cannot make it fit, so no Retry-After,
    and `x-should-retry: false` (the openai client retries every other 429); the x-ratelimit
    headers only. Its rejection reason is `request_too_large`. The prompt is not judged so:
    the gateway's estimate of it (characters / 4) is a guess, exact only at the engine."""

    def __init__(self, tenant: str, limit: int, requested: int, hdrs: dict[str, str]) -> None:
        ApiError.__init__(
            self,
            429,
            f"Request too large for tenant {tenant} on {_WHAT['completion_tokens_per_minute']} "
            f"(TPM): Limit {limit}, Requested {requested}. Lower max_tokens (or n): a "
            "request's max_tokens x n must fit within the limit.",
            type="tokens",
            code="rate_limit_exceeded",
            headers={**hdrs, "x-should-retry": "false"},
        )
        self.reason = "request_too_large"


@dataclass(slots=True)
class Lease:
    """One admitted request of a tenant: what it has been charged, where it is counted."""

    tenant: str
    slot: int
    remote: bool = False  # counted in the shared store (its end must be told there)
    prompt: int = 0
    completion: int = 0
    done: bool = False
    counted: bool = False  # holds a stream in the tables
    headers: dict[str, str] | None = None


class Limiter:
    """The tenants' limits in one process (module doc). `replicas`/`rank` come from
    discovery (the main process's snapshot); they size the local shares."""

    def __init__(
        self,
        tenants: list[TenantSpec],
        settings: RateLimitSettings,
        table: TenantTable,
        slots: dict[str, int],
    ) -> None:
        self.tenants = {t.name: t for t in tenants}
        self.settings = settings
        self.table = table
        self.slots = slots
        self.replicas = 1
        self.rank = 0
        # Where replicas/rank come from in a single process with discovery (workers get
        # them from the main process's state instead).
        self.peers: Callable[[], tuple[int, int]] | None = None
        self.store: RedisStore | None = None
        if settings.store == "redis" and settings.redis_url and any(_limited(t) for t in tenants):
            self.store = RedisStore(settings.redis_url, settings.redis_timeout_s, table)
        self.clock: Callable[[], float] = time.monotonic
        self.store_s = 0.0  # seconds spent waiting on the store at admission (measured)
        self.store_calls = 0

    def limits(self, name: str) -> tuple[list[int | None], int | None]:
        lim = self.tenants[name].limits
        return [getattr(lim, k) for k in LIMIT_KEYS], lim.concurrent_streams

    def share(self, total: int | None) -> int | None:
        """This replica's share of a limit (the whole of it with one replica)."""
        if total is None:
            return None
        if self.peers is not None:
            self.replicas, self.rank = self.peers()
        return cap_share(total, self.replicas, self.rank)

    async def admit(self, name: str, estimate: tuple[float, float] = (0.0, 0.0)) -> Lease:
        """Take one request (and a stream) of tenant `name`, or raise RateLimited.
        `estimate`: the request's prompt and completion tokens as guessed before it runs
        (prompt length, max_tokens): its x-ratelimit token headers say what is left after
        it, as OpenAI's do; the buckets take only what the engine reports."""
        lease = Lease(name, self.slots[name])
        per_min, conc = self.limits(name)
        if all(v is None for v in per_min) and conc is None:
            return lease
        # A request asking for more completion tokens than the whole limit could never be
        # served in full: refused at once, as OpenAI does (max_tokens x n is exact; the
        # prompt's estimate is not, and is left to the bucket).
        v, want = per_min[2], math.ceil(estimate[1] - 1e-9)
        if v is not None and want > v:
            raise TooLarge(name, v, want, self.headers_now(name))
        shares = [self.share(v) for v in per_min]
        store = self.store
        if store is not None and store.usable():
            t0 = time.perf_counter()
            res = await store.admit(name, per_min, conc)
            self.store_s += time.perf_counter() - t0
            self.store_calls += 1
            if res is not None:
                ok, reason, retry_s, levels = res
                if not ok:
                    hdrs = _headers(per_min, levels)
                    limit = (
                        conc
                        if reason == "concurrent_streams"
                        else per_min[LIMIT_KEYS.index(reason)]
                    )
                    raise RateLimited(name, reason, limit or 0, retry_s, hdrs)
                lease.remote = True
                lease.headers = _headers(per_min, _after(levels, estimate))
                self._take_local(lease, shares, force=True)
                return lease
        self._take_local(lease, shares, conc=self.share(conc), estimate=estimate)
        return lease

    def _take_local(
        self,
        lease: Lease,
        per_min: list[int | None],
        conc: int | None = None,
        force: bool = False,
        estimate: tuple[float, float] = (0.0, 0.0),
    ) -> None:
        """Check and take in the shared table; `force`: take without checking (the shared
        store decided), so that a fallback to local shares starts from this replica's own
        usage. `estimate`: as `admit`'s, for the headers it sets."""
        tb, slot = self.table, lease.slot
        with tb.lock():
            now = self.clock()
            levels = [tb.level(slot, k, float(v or 1), now) for k, v in enumerate(per_min)]
            if not force:
                if conc is not None and tb.open_streams(slot) >= conc:
                    raise RateLimited(
                        lease.tenant, "concurrent_streams", conc, 1.0, _headers(per_min, levels)
                    )
                for k, v in enumerate(per_min):
                    # Every bucket must hold one unit; only the request bucket takes it now.
                    if v is not None and (over := levels[k] + 1 - v) > 0:
                        raise RateLimited(
                            lease.tenant,
                            LIMIT_KEYS[k],
                            v,
                            over * 60.0 / v,
                            _headers(per_min, levels),
                        )
            if per_min[0] is not None:
                tb.add(slot, 0, 1.0, float(per_min[0]), now)
                levels[0] += 1
            tb.streams[tb.row, slot] += 1
            lease.counted = True
        if lease.headers is None:
            lease.headers = _headers(per_min, _after(levels, estimate))

    def adopt(self, name: str, prompt: int, completion: int, remote: bool) -> Lease | None:
        """A stream of tenant `name` handed over from another worker at a reload (it was
        admitted there): counted again here as an open stream, without a check and without
        a request, with the tokens already charged there (only what comes after is charged
        here). None for a tenant this process does not know."""
        slot = self.slots.get(name)
        if slot is None:
            return None
        lease = Lease(name, slot, remote=remote and self.store is not None)
        lease.prompt, lease.completion = prompt, completion
        tb = self.table
        with tb.lock():
            tb.streams[tb.row, slot] += 1
        lease.counted = True
        if lease.remote and self.store is not None:
            self.store.pend(name, 0, 0, 1)
        return lease

    def charge(self, lease: Lease, prompt: int | None, completion: int | None) -> None:
        """The request's tokens so far (totals, as its usage says): what is new is charged
        (a total that steps back, a split's given-back tokens, charges nothing)."""
        dp = max(0, (prompt or 0) - lease.prompt)
        dc = max(0, (completion or 0) - lease.completion)
        if not (dp or dc):
            return
        lease.prompt += dp
        lease.completion += dc
        per_min, _ = self.limits(lease.tenant)
        tb = self.table
        with tb.lock():
            now = self.clock()
            for k, n in ((1, dp), (2, dc)):
                if n and per_min[k] is not None:
                    tb.add(lease.slot, k, float(n), float(self.share(per_min[k]) or 1), now)
        if lease.remote and self.store is not None:
            self.store.pend(lease.tenant, dp, dc, 0)

    def finish(
        self, lease: Lease, prompt: int | None = None, completion: int | None = None
    ) -> None:
        """The request is over: its last tokens charged, its stream closed (once)."""
        if lease.done:
            return
        self.charge(lease, prompt, completion)
        lease.done = True
        if lease.counted:
            tb = self.table
            with tb.lock():
                tb.streams[tb.row, lease.slot] -= 1
        if lease.remote and self.store is not None:
            self.store.pend(lease.tenant, 0, 0, -1)

    def headers_now(self, name: str) -> dict[str, str]:
        """The x-ratelimit headers of tenant `name` from this replica's table."""
        per_min, _ = self.limits(name)
        shares = [self.share(v) for v in per_min]
        tb, now = self.table, self.clock()
        slot = self.slots[name]
        return _headers(
            shares, [tb.level(slot, k, float(v or 1), now) for k, v in enumerate(shares)]
        )

    async def close(self) -> None:
        if self.store is not None:
            await self.store.close()


def _limited(t: TenantSpec) -> bool:
    return any(getattr(t.limits, k) is not None for k in REASONS)


def _after(levels: list[float], estimate: tuple[float, float]) -> list[float]:
    """The levels once the request's estimated tokens are taken (for its headers only)."""
    return [levels[0], levels[1] + estimate[0], levels[2] + estimate[1]]


def _headers(per_min: list[int | None], levels: list[float]) -> dict[str, str]:
    """OpenAI's x-ratelimit headers: requests; `tokens` for the token limit with the fewest
    left (prompt or completion, by fraction); and each token limit by name."""
    h: dict[str, str] = {}
    rpm = per_min[0]
    if rpm is not None:
        h["x-ratelimit-limit-requests"] = str(rpm)
        h["x-ratelimit-remaining-requests"] = str(max(0, math.floor(rpm - levels[0])))
        h["x-ratelimit-reset-requests"] = reset_text(levels[0] * 60.0 / rpm)
    best: tuple[float, str] | None = None
    for k, name in ((1, "prompt-tokens"), (2, "completion-tokens")):
        v = per_min[k]
        if v is None:
            continue
        left = max(0, math.floor(v - levels[k]))
        h[f"x-ratelimit-limit-{name}"] = str(v)
        h[f"x-ratelimit-remaining-{name}"] = str(left)
        h[f"x-ratelimit-reset-{name}"] = reset_text(levels[k] * 60.0 / v)
        if best is None or left / v < best[0]:
            best = (left / v, name)
    if best is not None:
        for part in ("limit", "remaining", "reset"):
            h[f"x-ratelimit-{part}-tokens"] = h[f"x-ratelimit-{part}-{best[1]}"]
    return h
