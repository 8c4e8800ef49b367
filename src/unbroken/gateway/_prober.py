"""Per-endpoint background loop: health, two-stage readiness, load scraping.

starting --/health 200--> warming --warm-up completion within budget--> ready.
Ready endpoints keep being checked: consecutive failures take one out of rotation (it stays
ready, marked unhealthy) until it answers again; `vllm:num_requests_waiting`,
`vllm:num_requests_running` and `vllm:kv_cache_usage_perc` feed the load score.
An endpoint's models (served names and LoRA adapters, `/v1/models`) are read at warm-up, and
again at every probe while its metrics show LoRA on (`vllm:lora_requests_info`, which also
feeds adapter affinity, `_adapters.py`): adapters loaded or unloaded at runtime
(`/v1/load_lora_adapter`) join or leave its models within a probe interval.
An endpoint the proxy caught hanging (`suspect`: no first byte in time, a stalled stream, a
request past its timeout) may well keep a green /health: it stays out of rotation until a
real completion succeeds again, and not before a hold that doubles with each hang caught
soon after it came back (`_HOLD_BASE_S`, 2x per strike, at most `_HOLD_MAX_S`): an engine that
passes the small hang check but hangs real requests (a kernel path only real prompts take)
would otherwise be back in rotation a probe later, catching the next real requests each time.
The strikes are forgotten once it has stayed in rotation for `_FORGET_S`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp
import orjson

from unbroken.gateway._adapters import LORA_METRIC, parse_lora_info
from unbroken.gateway._pool import Endpoint, State
from unbroken.wire.metrics import FilteredReads, filtered_path

__all__ = ["METRICS_PATH", "Prober", "parse_load"]

log = logging.getLogger("unbroken.gateway.prober")

_HOLD_BASE_S = 2.0
_HOLD_MAX_S = 120.0
_FORGET_S = 60.0


class _Hold:
    """An endpoint caught hanging: hangs caught since it last stayed in rotation for
    `_FORGET_S` (`strikes`), when its hold ends, and when it last came back."""

    __slots__ = ("back_at", "strikes", "until")

    def __init__(self) -> None:
        self.strikes = 0
        self.until = 0.0
        self.back_at: float | None = None

    def caught(self, now: float) -> float:
        """Caught hanging at `now`: the hold, doubling per strike soon after coming back."""
        if self.back_at is None or now - self.back_at > _FORGET_S:
            self.strikes = 0
        self.strikes += 1
        hold = min(_HOLD_MAX_S, _HOLD_BASE_S * 2 ** (self.strikes - 1))
        self.until = now + hold
        return hold


# Counted per engine step by vLLM (and the simulator): rising, the engine makes progress,
# though a non-streaming answer shows the gateway nothing until it is whole
# (`Endpoint.progress_at`, `_health.EndpointHealth.alive`).
GENERATED = "vllm:generation_tokens_total"

# The series the prober reads, asked for by name (`wire.metrics.FilteredReads`): an engine
# that honours the filter (the simulator) renders these instead of its whole page (~40 KB,
# ~6 ms of its process here, against ~1 ms). vLLM 0.32 ignores the query and sends the whole
# page, which parses the same.
METRICS_PATH = filtered_path(
    (
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        GENERATED,
        LORA_METRIC,
    )
)


def _said(e: BaseException) -> str:
    """An exception for a log line: its name and text; a timeout's text is empty, so it says
    what timed out (a review read `/health: TimeoutError: ` as a cut-off line)."""
    text = str(e)
    if isinstance(e, TimeoutError) and not text:
        return "TimeoutError: no answer in time"
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def parse_load(text: str) -> tuple[float, float, float, float | None]:
    """(waiting, running, kv_usage, tokens generated so far or None) from a vLLM /metrics
    page; sums over label sets."""
    waiting = running = 0.0
    kv = 0.0
    generated: float | None = None
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name_end = line.find("{")
        if name_end < 0:
            name_end = line.find(" ")
        name = line[:name_end]
        try:
            value = float(line[line.rfind("}") + 1 if "}" in line else name_end :].split()[0])
        except (ValueError, IndexError):
            continue
        if name == "vllm:num_requests_waiting":
            waiting += value
        elif name == "vllm:num_requests_running":
            running += value
        elif name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
            kv = max(kv, value)
        elif name == GENERATED:
            generated = (generated or 0.0) + value
    return waiting, running, kv, generated


def fingerprint_of(body: bytes) -> str | None:
    """The `system_fingerprint` of a completion's answer (None: none, or not JSON: an engine
    that answers otherwise still warms up)."""
    try:
        fp = orjson.loads(body).get("system_fingerprint")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return fp if isinstance(fp, str) else None


class Prober:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        *,
        interval: float,
        fail_threshold: int,
        warmup_timeout: float,
        on_change: Callable[[Endpoint], None],
        headers_for: Callable[[Endpoint], dict[str, str]] | None = None,
        on_restart: Callable[[Endpoint], None] | None = None,
    ) -> None:
        self.session = session
        self.interval = interval
        self.fail_threshold = fail_threshold
        self.warmup_timeout = warmup_timeout
        self.on_change = on_change
        self.headers_for = headers_for or (lambda _ep: {})
        self.on_restart = on_restart or (lambda _ep: None)
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.suspects: set[str] = set()
        self._holds: dict[str, _Hold] = {}  # per endpoint caught hanging at least once
        self._metrics = FilteredReads(METRICS_PATH)

    def suspect(self, ep: Endpoint) -> None:
        """Out of rotation until its hold has passed and a completion succeeds (see the
        module docstring)."""
        if ep.name in self.suspects:
            return
        now = time.monotonic()
        h = self._holds.setdefault(ep.name, _Hold())
        hold = h.caught(now)
        self.suspects.add(ep.name)
        if h.strikes > 1:
            log.warning(
                "%s hung again %.0f s after it came back: held out %.0f s",
                ep.name,
                now - (h.back_at or now),
                hold,
            )
        if ep.healthy:
            ep.healthy = False
            log.warning("%s out of rotation: it hangs (%s)", ep.name, ep.last_error or "no detail")
            self.on_change(ep)

    def watch(self, ep: Endpoint) -> None:
        self.tasks[ep.name] = asyncio.create_task(self._loop(ep), name=f"probe-{ep.name}")

    def forget(self, name: str) -> None:
        self.suspects.discard(name)
        self._holds.pop(name, None)
        if (t := self.tasks.pop(name, None)) is not None:
            t.cancel()

    async def close(self) -> None:
        for t in self.tasks.values():
            t.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        self.tasks.clear()

    async def _get(self, ep: Endpoint, path: str, timeout: float) -> tuple[int, bytes]:
        async with self.session.get(
            ep.url + path,
            timeout=aiohttp.ClientTimeout(total=timeout),
            headers=self.headers_for(ep),
        ) as r:
            return r.status, await r.read()

    async def _loop(self, ep: Endpoint) -> None:
        while ep.state != State.GONE:
            try:
                await self.check(ep)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("probe of %s failed unexpectedly", ep.name)
            await asyncio.sleep(self.interval)

    async def check(self, ep: Endpoint) -> None:
        try:
            status, _ = await self._get(ep, "/health", 2.0)
            ok = status == 200
            err = None if ok else f"/health answered {status}"
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as e:
            ok, err = False, f"/health: {_said(e)}"
        if not ok:
            ep.failures += 1
            ep.down = ep.failures >= self.fail_threshold
            ep.note_error(err or "/health failed")
            if ep.healthy and ep.failures >= self.fail_threshold and ep.state == State.READY:
                ep.healthy = False
                log.warning("%s out of rotation: %s", ep.name, err)
                self.on_change(ep)
            return
        ep.failures = 0
        ep.down = False
        if ep.state == State.STARTING:
            ep.set_state(State.WARMING)
            log.info("%s: stage 1 passed (/health)", ep.name)
        if ep.state == State.WARMING:
            await self._warm(ep)
            return
        if ep.name in self.suspects:
            if (h := self._holds.get(ep.name)) is not None and time.monotonic() < h.until:
                return
            try:
                took = await self._complete(ep, sorted(ep.models)[0] if ep.models else "")
            except (aiohttp.ClientError, TimeoutError, ConnectionError, RuntimeError) as e:
                ep.note_error(f"hang check: {_said(e)}")
                return
            self.suspects.discard(ep.name)
            if h is not None:
                h.back_at = time.monotonic()
            log.info("%s served a completion again (%.0f ms)", ep.name, took * 1e3)
        if not ep.healthy:
            ep.healthy = True
            log.info("%s back in rotation", ep.name)
            self.on_change(ep)
        if ep.state in (State.READY, State.DRAINING):
            await self._scrape(ep)

    async def _models(self, ep: Endpoint) -> None:
        status, body = await self._get(ep, "/v1/models", 5.0)
        if status in (401, 403):
            raise RuntimeError(
                f"/v1/models answered {status}: the engine wants an API key (vLLM --api-key); "
                "give it with --upstream-key-env VAR or `upstream_key_env` (the client's "
                "Authorization is never forwarded)"
            )
        if status != 200:
            raise RuntimeError(f"/v1/models answered {status}")
        data = orjson.loads(body).get("data", [])
        models = {m["id"] for m in data}
        if not models:
            raise RuntimeError("/v1/models lists no model")
        ep.models = models
        # vLLM lists a LoRA adapter with its base as `parent` (base models: null).
        ep.adapters = {
            m["id"]: m["parent"] for m in data if isinstance(m.get("parent"), str) and m["parent"]
        }

    async def _warm(self, ep: Endpoint) -> None:
        """Stage 2: a real completion must succeed within the warm-up budget."""
        try:
            await self._models(ep)
            if ep.warmup:
                took = await self._complete(ep, sorted(ep.models)[0])
                log.info("%s: stage 2 passed (warm-up in %.0f ms)", ep.name, took * 1e3)
        except (
            aiohttp.ClientError,
            TimeoutError,
            ConnectionError,
            RuntimeError,
            ValueError,
            KeyError,
            orjson.JSONDecodeError,
        ) as e:
            ep.note_error(f"warm-up: {_said(e)}")
            log.warning("%s not ready: %s", ep.name, ep.last_error)
            return
        if ep.state == State.WARMING:
            ep.healthy = True
            ep.last_error = ep.last_error_at = None
            ep.set_state(State.READY)
            log.info("%s ready (pool %s)", ep.name, ep.pool)
            self.on_change(ep)

    async def _complete(self, ep: Endpoint, model: str) -> float:
        """One real completion within the warm-up budget; its seconds."""
        t0 = time.monotonic()
        async with self.session.post(
            ep.url + "/v1/completions",
            json={"model": model, "prompt": "warm up", "max_tokens": 1, "temperature": 0},
            timeout=aiohttp.ClientTimeout(total=self.warmup_timeout),
            headers=self.headers_for(ep),
        ) as r:
            body = await r.read()
            if r.status != 200:
                raise RuntimeError(f"completion answered {r.status}")
        took = ep.warmup_s = time.monotonic() - t0
        ep.fingerprint = fingerprint_of(body)
        return took

    async def _scrape(self, ep: Endpoint) -> None:

        async def page(path: str) -> str | None:
            status, body = await self._get(ep, path, 2.0)
            return body.decode(errors="replace") if status == 200 else None

        try:
            text = await self._metrics.read(ep.url, page)
        except (aiohttp.ClientError, TimeoutError, ConnectionError):
            return
        if text is None:
            return
        waiting, running, kv, generated = parse_load(text)
        ep.scraped(waiting, running, kv)
        if generated is not None:
            if generated > ep.generated and ep.generated >= 0:
                ep.progress_at = time.monotonic()
            elif generated < ep.generated:
                # A counter went back: a new engine process at the same address (a container
                # restarted in place keeps its pod's IP), its KV cache empty.
                log.info(
                    "%s restarted (vllm:generation_tokens_total went back from %.0f to %.0f): "
                    "the prefixes routed there before are forgotten",
                    ep.name,
                    ep.generated,
                    generated,
                )
                self.on_restart(ep)
            ep.generated = generated
        ep.lora = parse_lora_info(text)
        if ep.lora is not None:
            await self._refresh_models(ep)

    async def read_models(self, eps: list[Endpoint]) -> None:
        """Read these endpoints' /v1/models now rather than at their next probe (a request
        named a model none is known to serve: `Handlers._learned`)."""
        await asyncio.gather(*(self._refresh_models(ep) for ep in eps))

    async def _refresh_models(self, ep: Endpoint) -> None:
        """Re-read /v1/models (adapters come and go at runtime); a failed read keeps the
        models known, and a change wakes whatever waits for an endpoint of a model."""
        before = ep.models
        try:
            await self._models(ep)
        except (
            aiohttp.ClientError,
            TimeoutError,
            ConnectionError,
            RuntimeError,
            ValueError,
            KeyError,
            TypeError,
            AttributeError,
            orjson.JSONDecodeError,
        ) as e:
            log.debug("%s: /v1/models: %s", ep.name, e)
            return
        if ep.models != before:
            log.info("%s serves %s (was %s)", ep.name, sorted(ep.models), sorted(before))
            self.on_change(ep)
