"""Per-tenant limits (issue 25): requests, prompt and completion tokens per minute, and
concurrent streams, enforced at admission, exact across the gateway's workers and, with
`rate_limit.store: redis`, across its replicas (docs/gateway.md, "Tenants").

Each per-minute limit L is a token bucket: it holds L, refills at L/60 per second, and a
request takes what it uses. Stored as the *level used* (0 = full bucket), which drains at
L/60 per second, and the time it was last written. A request is admitted when every
bucket of its tenant holds at least one unit (`level + 1 <= L`); the request bucket takes
its one at once, the token buckets take the tokens as the engine reports them (usage), so
one long answer may drive a token level past L, and the tenant's next requests wait until it
has drained again. A stream in progress is never cut. This is what OpenAI's headers
describe: `remaining` is what the bucket holds now, `reset` when it is full again.

Where the levels live:
- `TenantTable`: one shared-memory file for all workers of a gateway (next to the admission
  table): per tenant slot the three buckets (level, time) and, per worker row, the streams
  it has open. Check-then-take runs under one `lockf` lock (microseconds); a dead worker's
  row is zeroed by the main process, so its streams' slots come back.
- `RedisStore`: one Lua script per admission (one round trip); token charges and stream
  ends go in one pipeline per flush, sent as soon as the previous one is done. Streams are
  counted per client (a worker of a replica) under an `alive` key with a TTL that admitting
  and a timer refresh; a dead client's streams stop counting when its key expires.

The local table is always kept (this replica's own usage). With no store, or while Redis is
unreachable, each replica enforces its share of every limit (`cap_share`, as the caps).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import math
import mmap
import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from unbroken.wire.errors import ApiError

if TYPE_CHECKING:
    from unbroken.config.tenants import RateLimitSettings, TenantSpec

__all__ = [
    "LIMIT_KEYS",
    "MAX_TENANTS",
    "REASONS",
    "Lease",
    "Limiter",
    "RateLimited",
    "RedisStore",
    "TenantTable",
    "cap_share",
    "reset_text",
]

log = logging.getLogger("unbroken.gateway")

MAX_TENANTS = 1024
_ROWS = 64  # as many as the admission table's (MAX_WORKERS)
KINDS = ("requests", "prompt_tokens", "completion_tokens")
LIMIT_KEYS = ("requests_per_minute", "prompt_tokens_per_minute", "completion_tokens_per_minute")
# Why a request was refused (the rejections metric's `reason`).
REASONS = (*LIMIT_KEYS, "concurrent_streams")
PROBE_S = 1.0  # how often an unreachable store is tried again
ALIVE_TTL_S = 15  # a Redis client's streams count while its alive key lives
ALIVE_EVERY_S = 5.0
WARM_S = 2.0  # the first connection and script load may take this long (once)


# Store calls in a row that time out before the store counts as down (one slow answer on a
# busy machine is not an outage; a refused connection is, at once).
TIMEOUTS_DOWN = 3


def cap_share(total: int, replicas: int, rank: int) -> int:
    """This replica's part of `total` (as `_discovery.cap_share`): parts add up to `total`."""
    replicas = max(1, replicas)
    return max(1, total // replicas + (1 if rank < total % replicas else 0))


def reset_text(seconds: float) -> str:
    """OpenAI's duration form for the `x-ratelimit-reset-*` headers: `1s`, `6m0s`, `20ms`."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{max(1, math.ceil(seconds * 1000))}ms"
    m, s = divmod(seconds, 60)
    if m >= 60:
        h, m = divmod(m, 60)
        return f"{int(h)}h{int(m)}m{s:.0f}s"
    return f"{int(m)}m{s:.0f}s" if m else f"{s:.3g}s"


class TenantTable:
    """The levels of every tenant's buckets and its open streams (module doc). One file
    shared by the workers (`path`), or anonymous memory for a single process."""

    def __init__(self, path: Path | None = None, *, create: bool = False, row: int = 0) -> None:
        self.path = path
        self.row = row
        n_b = MAX_TENANTS * len(KINDS) * 2
        n_s = _ROWS * MAX_TENANTS
        size = 8 * (n_b + n_s + 8)
        self._fd = -1
        if path is None:
            self._map = mmap.mmap(-1, size)
        else:
            flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
            self._fd = os.open(path, flags, 0o600)
            if create:
                os.ftruncate(self._fd, size)
            self._map = mmap.mmap(self._fd, size)
        flat = np.frombuffer(self._map, dtype=np.float64)
        self.buckets = flat[:n_b].reshape(MAX_TENANTS, len(KINDS), 2)
        ints = np.frombuffer(self._map, dtype=np.int64)
        self.streams = ints[n_b : n_b + n_s].reshape(_ROWS, MAX_TENANTS)
        self.flags = ints[n_b + n_s :]  # [0]: the shared store is down (1) or not (0)

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        if self._fd < 0:
            yield
            return
        fcntl.lockf(self._fd, fcntl.LOCK_EX, 1, 0)
        try:
            yield
        finally:
            fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, 0)

    def level(self, slot: int, kind: int, limit: float, now: float) -> float:
        lvl, t = self.buckets[slot, kind]
        return max(0.0, float(lvl) - max(0.0, now - float(t)) * limit / 60.0)

    def add(self, slot: int, kind: int, n: float, limit: float, now: float) -> None:
        b = self.buckets[slot, kind]
        b[0] = self.level(slot, kind, limit, now) + n
        b[1] = now

    def open_streams(self, slot: int) -> int:
        return int(self.streams[:, slot].sum())

    def clear_row(self, row: int) -> None:
        """A worker is gone: its open streams are no longer open."""
        self.streams[row, :] = 0

    def clear_slot(self, slot: int) -> None:
        """A slot given to a tenant new to this gateway starts empty."""
        self.buckets[slot] = 0.0
        self.streams[:, slot] = 0

    def close(self) -> None:
        del self.buckets, self.streams, self.flags
        with contextlib.suppress(BufferError):
            self._map.close()
        if self._fd >= 0:
            os.close(self._fd)


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


@dataclass(slots=True)
class _Pending:
    prompt: int = 0
    completion: int = 0
    streams: int = 0


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

    async def admit(self, name: str) -> Lease:
        """Take one request (and a stream) of tenant `name`, or raise RateLimited."""
        lease = Lease(name, self.slots[name])
        per_min, conc = self.limits(name)
        if all(v is None for v in per_min) and conc is None:
            return lease
        shares = [self.share(v) for v in per_min]
        store = self.store
        if store is not None and store.usable():
            t0 = time.perf_counter()
            res = await store.admit(name, per_min, conc)
            self.store_s += time.perf_counter() - t0
            self.store_calls += 1
            if res is not None:
                ok, reason, retry_s, levels = res
                hdrs = _headers(per_min, levels)
                if not ok:
                    limit = (
                        conc
                        if reason == "concurrent_streams"
                        else per_min[LIMIT_KEYS.index(reason)]
                    )
                    raise RateLimited(name, reason, limit or 0, retry_s, hdrs)
                lease.remote = True
                lease.headers = hdrs
                self._take_local(lease, shares, force=True)
                return lease
        self._take_local(lease, shares, conc=self.share(conc))
        return lease

    def _take_local(
        self,
        lease: Lease,
        per_min: list[int | None],
        conc: int | None = None,
        force: bool = False,
    ) -> None:
        """Check and take in the shared table; `force`: take without checking (the shared
        store decided), so that a fallback to local shares starts from this replica's own
        usage."""
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
            lease.headers = _headers(per_min, levels)

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


# KEYS[1]: the tenant's buckets (hash), KEYS[2]: its open streams per client (hash).
# ARGV: client id, alive-key prefix, rpm, prompt tpm, completion tpm, concurrent (0: none),
# the alive key's TTL (admitting refreshes this client's alive key).
# Returns {ok, reason (0 ok, 1-3 a per-minute limit, 4 streams), retry_ms, level x3}.
_ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local lim = {tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])}
local conc = tonumber(ARGV[6])
local names = {'r', 'p', 'c'}
local lv = {0, 0, 0}
for k = 1, 3 do
  if lim[k] > 0 then
    local l = tonumber(redis.call('HGET', KEYS[1], names[k] .. 'l') or '0')
    local tt = tonumber(redis.call('HGET', KEYS[1], names[k] .. 't') or tostring(now))
    lv[k] = math.max(0, l - math.max(0, now - tt) * lim[k] / 60)
  end
end
local function out(ok, why, ms)
  return {ok, why, ms, tostring(lv[1]), tostring(lv[2]), tostring(lv[3])}
end
if conc > 0 then
  local open = 0
  local all = redis.call('HGETALL', KEYS[2])
  for i = 1, #all, 2 do
    if all[i] == ARGV[1] or redis.call('EXISTS', ARGV[2] .. all[i]) == 1 then
      open = open + tonumber(all[i + 1])
    else
      redis.call('HDEL', KEYS[2], all[i])
    end
  end
  if open >= conc then return out(0, 4, 1000) end
end
for k = 1, 3 do
  if lim[k] > 0 and lv[k] + 1 > lim[k] then
    return out(0, k, math.ceil((lv[k] + 1 - lim[k]) * 60000 / lim[k]))
  end
end
if lim[1] > 0 then
  lv[1] = lv[1] + 1
  redis.call('HSET', KEYS[1], 'rl', tostring(lv[1]), 'rt', tostring(now))
end
redis.call('HINCRBY', KEYS[2], ARGV[1], 1)
redis.call('SET', ARGV[2] .. ARGV[1], '1', 'EX', ARGV[7])
redis.call('EXPIRE', KEYS[1], 3600)
redis.call('EXPIRE', KEYS[2], 3600)
return out(1, 0, 0)
"""
# KEYS as above. ARGV: client id, prompt tpm, completion tpm, prompt tokens, completion
# tokens, streams delta.
_CHARGE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local lim = {tonumber(ARGV[2]), tonumber(ARGV[3])}
local add = {tonumber(ARGV[4]), tonumber(ARGV[5])}
local names = {'p', 'c'}
for k = 1, 2 do
  if lim[k] > 0 and add[k] > 0 then
    local l = tonumber(redis.call('HGET', KEYS[1], names[k] .. 'l') or '0')
    local tt = tonumber(redis.call('HGET', KEYS[1], names[k] .. 't') or tostring(now))
    l = math.max(0, l - math.max(0, now - tt) * lim[k] / 60) + add[k]
    redis.call('HSET', KEYS[1], names[k] .. 'l', tostring(l), names[k] .. 't', tostring(now))
  end
end
local d = tonumber(ARGV[6])
if d ~= 0 then
  if redis.call('HINCRBY', KEYS[2], ARGV[1], d) <= 0 then
    redis.call('HDEL', KEYS[2], ARGV[1])
  end
end
redis.call('EXPIRE', KEYS[1], 3600)
return 1
"""
_REASON = {1: LIMIT_KEYS[0], 2: LIMIT_KEYS[1], 3: LIMIT_KEYS[2], 4: "concurrent_streams"}


class RedisStore:
    """The tenants' counters in Redis, shared by every replica (module doc). Unreachable
    (an error, or no answer within `timeout`): `usable()` turns False for every worker of
    this gateway (a flag in the shared table; the worker that flips it logs once),
    requests are admitted on local shares, and the store is tried again every PROBE_S."""

    PREFIX = "unbroken:rl:"

    _timeouts = 0  # store calls in a row that timed out

    def __init__(self, url: str, timeout: float, table: TenantTable) -> None:
        import redis.asyncio as aioredis

        self.url = url
        self.timeout = timeout
        self.table = table
        self.client_id = uuid.uuid4().hex[:16]
        self.r: Any = aioredis.Redis.from_url(
            url,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry_on_timeout=False,
        )
        self._admit = self.r.register_script(_ADMIT)
        self._charge = self.r.register_script(_CHARGE)
        self._pending: dict[str, _Pending] = {}
        self._flushing: asyncio.Task[None] | None = None
        self._probe: asyncio.Task[None] | None = None
        self._alive: asyncio.Task[None] | None = None
        self._warm: asyncio.Task[None] | None = None
        self.limits: dict[str, tuple[int, int]] = {}  # tenant -> (prompt tpm, completion tpm)

    def _keys(self, tenant: str) -> list[str]:
        return [f"{self.PREFIX}{tenant}", f"{self.PREFIX}{tenant}:streams"]

    async def warm(self) -> None:
        """Connect and load the scripts once, outside any request's time limit (a first
        call that connects and finds no script loaded takes several round trips)."""
        if self._warm is None:
            self._warm = asyncio.get_running_loop().create_task(self._warm_up())
        if not self._warm.done():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._warm), WARM_S)

    async def _warm_up(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.r.ping(), WARM_S)
            for script in (self._admit, self._charge):
                script.sha = await asyncio.wait_for(self.r.script_load(script.script), WARM_S)

    def usable(self) -> bool:
        """Is the store up, as far as this gateway knows? (Starts the timers on first use.)"""
        loop = asyncio.get_running_loop()
        if self._alive is None:
            self._alive = loop.create_task(self._keep_alive())
        down = bool(self.table.flags[0])
        if down and (self._probe is None or self._probe.done()):
            self._probe = loop.create_task(self._probing())
        return not down

    def _down(self, e: BaseException) -> None:
        tb = self.table
        with tb.lock():
            flipped = not tb.flags[0]
            tb.flags[0] = 1
        if flipped:
            log.warning(
                "rate-limit store %s unreachable (%s): serving on this replica's local shares "
                "of the tenants' limits until it is back",
                _safe_url(self.url),
                type(e).__name__,
            )
        if self._probe is None or self._probe.done():
            self._probe = asyncio.get_running_loop().create_task(self._probing())

    async def _probing(self) -> None:
        while self.table.flags[0]:
            await asyncio.sleep(PROBE_S)
            try:
                await asyncio.wait_for(self._refresh_alive(), max(self.timeout, 0.5))
            except Exception:  # any failure: still down
                continue
            tb = self.table
            with tb.lock():
                flipped = bool(tb.flags[0])
                tb.flags[0] = 0
            if flipped:
                log.warning(
                    "rate-limit store %s is back: the tenants' limits are shared again",
                    _safe_url(self.url),
                )
        if self._pending and (self._flushing is None or self._flushing.done()):
            self._flushing = asyncio.get_running_loop().create_task(self._flush())

    async def _refresh_alive(self) -> None:
        await self.r.set(f"{self.PREFIX}alive:{self.client_id}", b"1", ex=ALIVE_TTL_S)

    async def _keep_alive(self) -> None:
        while True:
            await asyncio.sleep(ALIVE_EVERY_S)
            if not self.table.flags[0]:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._refresh_alive(), max(self.timeout, 0.5))

    async def admit(
        self, tenant: str, per_min: list[int | None], conc: int | None
    ) -> tuple[bool, str, float, list[float]] | None:
        """One round trip; None when the store did not answer (it is then marked down)."""
        self.limits[tenant] = (per_min[1] or 0, per_min[2] or 0)
        if self._warm is None or not self._warm.done():
            await self.warm()
        try:
            res = await asyncio.wait_for(
                self._admit(
                    keys=self._keys(tenant),
                    args=[
                        self.client_id,
                        f"{self.PREFIX}alive:",
                        per_min[0] or 0,
                        per_min[1] or 0,
                        per_min[2] or 0,
                        conc or 0,
                        ALIVE_TTL_S,
                    ],
                ),
                self.timeout,
            )
        except Exception as e:  # never fail a request for the store
            # One slow answer on a busy machine is not an outage: that request is decided
            # on local shares, and only TIMEOUTS_DOWN in a row (or any other error, such as
            # a refused connection) mark the store down for every worker.
            self._timeouts = self._timeouts + 1 if isinstance(e, TimeoutError) else TIMEOUTS_DOWN
            if self._timeouts >= TIMEOUTS_DOWN:
                self._timeouts = 0
                self._down(e)
            return None
        self._timeouts = 0
        ok, reason, retry_ms = int(res[0]), int(res[1]), float(res[2])
        levels = [float(res[3]), float(res[4]), float(res[5])]
        return bool(ok), _REASON.get(reason, ""), retry_ms / 1000.0, levels

    def pend(self, tenant: str, prompt: int, completion: int, streams: int) -> None:
        """Tokens and stream ends to tell the store, sent in one pipeline as soon as the
        one before has gone (so they batch under load, and wait for no timer)."""
        p = self._pending.get(tenant)
        if p is None:
            p = self._pending[tenant] = _Pending()
        p.prompt += prompt
        p.completion += completion
        p.streams += streams
        if self._flushing is None or self._flushing.done():
            self._flushing = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        while self._pending and not self.table.flags[0]:
            todo, self._pending = self._pending, {}
            try:
                async with self.r.pipeline(transaction=False) as pipe:
                    for tenant, p in todo.items():
                        ptpm, ctpm = self.limits.get(tenant, (0, 0))
                        await self._charge(
                            keys=self._keys(tenant),
                            args=[self.client_id, ptpm, ctpm, p.prompt, p.completion, p.streams],
                            client=pipe,
                        )
                    await asyncio.wait_for(pipe.execute(), max(self.timeout, 0.5))
            except Exception as e:
                # Kept for when the store is back: the tokens were used, and its count of
                # this client's open streams must come down.
                for tenant, p in todo.items():
                    q = self._pending.setdefault(tenant, _Pending())
                    q.prompt += p.prompt
                    q.completion += p.completion
                    q.streams += p.streams
                self._down(e)
                return

    async def close(self) -> None:
        for t in (self._probe, self._alive):
            if t is not None:
                t.cancel()
        if self._flushing is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._flushing, 1.0)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(
                self.r.delete(f"{self.PREFIX}alive:{self.client_id}"), self.timeout
            )
        with contextlib.suppress(Exception):
            await self.r.aclose()


def _safe_url(url: str) -> str:
    """The store's URL without a password."""
    if "@" in url:
        scheme, _, rest = url.partition("://")
        return f"{scheme}://***@{rest.rpartition('@')[2]}"
    return url
