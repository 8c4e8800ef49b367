"""The tenants' counters in Redis (`rate_limit.store: redis`), shared by every replica of
the gateway: the remote half of the per-tenant limits (`_ratelimit.py` decides with it).

One Lua script per admission (one round trip); token charges and stream ends go in one
pipeline per flush, sent as soon as the previous one is done. Streams are counted per client
(a worker of a replica) under an `alive` key with a TTL that admitting and a timer refresh; a
dead client's streams stop counting when its key expires. Unreachable, the store is marked
down for every worker (a flag in the shared `TenantTable`) and the limiter falls back to
local shares. Apart from `_ratelimit` because it is a client of another system, with its own
timers, scripts and failure handling, and needs none of the limiter's logic.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from dataclasses import dataclass
from typing import Any

from unbroken.gateway._tenant_table import LIMIT_KEYS, TenantTable

__all__ = ["TIMEOUTS_DOWN", "RedisStore"]

log = logging.getLogger("unbroken.gateway")

PROBE_S = 1.0  # how often an unreachable store is tried again
ALIVE_TTL_S = 15  # a Redis client's streams count while its alive key lives
ALIVE_EVERY_S = 5.0
WARM_S = 2.0  # the first connection and script load may take this long (once)


# Store calls in a row that time out before the store counts as down (one slow answer on a
# busy machine is not an outage; a refused connection is, at once).
TIMEOUTS_DOWN = 3


@dataclass(slots=True)
class _Pending:
    prompt: int = 0
    completion: int = 0
    streams: int = 0


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
