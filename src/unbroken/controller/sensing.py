"""What the controller reads each window, and what it says about reading it: every gateway's
endpoint listing (merged over replicas), every agent's eBPF windows (merged by endpoint),
each engine's own vLLM metrics, the agent's coverage of each endpoint, and the probes sent
to an endpoint that was routed around so that it produces a signal again.

It learns of contention only from measured signals (the agent's uprobe histograms, the
engines' vLLM metrics): it never asks an engine what fault it was given. Outages of a
gateway or the agent are said once each, after a start-up grace."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import Any

import aiohttp

from unbroken.clients import AdminRejected, GatewayAdmin
from unbroken.controller.actions import EndpointView
from unbroken.controller.config import ControllerConfig
from unbroken.controller.metrics import ControllerMetrics
from unbroken.controller.signals import (
    ENGINE_METRICS_PATH,
    HistogramDelta,
    agent_windows,
    engine_window,
)
from unbroken.controller.sources import Sources
from unbroken.wire.metrics import FilteredReads

__all__ = ["AGENT_START_GRACE_S", "UNCOVERED_S", "Sensing", "engine_state"]

log = logging.getLogger("unbroken.controller")

UNCOVERED_S = 5.0  # decoding seconds a live agent may be silent about before a warning
# An agent started beside the controller (`unbroken up`, a DaemonSet rolling out) takes a
# moment to listen: until it has answered once, this long passes before "unreachable" warns.
AGENT_START_GRACE_S = 10.0

Spawn = Callable[[Coroutine[Any, Any, None]], None]


class Sensing:
    """The reads of one window and their state between windows: histogram deltas, the
    gateways' admin clients and last listings, the agent's state, probes in flight."""

    def __init__(self, cfg: ControllerConfig, metrics: ControllerMetrics, spawn: Spawn) -> None:
        self.cfg = cfg
        self.s = cfg.settings
        self.metrics = metrics
        self._spawn = spawn
        self.sources = Sources(
            cfg.admin_urls,
            cfg.agent_urls,
            gateway_service=cfg.gateway_service,
            agent_service=cfg.agent_service,
        )
        self._admins: dict[str, GatewayAdmin] = {}
        # What each gateway listed last window: name → view (to apply only what differs).
        self.gateway_views: dict[str, dict[str, EndpointView]] = {}
        # ... each gateway's routes override as it reports it (absent: not read this window)
        self.gateway_routes: dict[str, dict[str, list[str]]] = {}
        # Every endpoint name a gateway listed last window, in whatever state (a restarted
        # gateway lists its endpoints before their health checks pass).
        self.listed_any: set[str] = set()
        # Called with a gateway's admin URL once discovery no longer lists it.
        self.on_gateway_gone: Callable[[str], None] = lambda url: None
        self._agent_deltas: dict[str, HistogramDelta] = {}
        self._engine_deltas: dict[str, HistogramDelta] = {}
        self.session: aiohttp.ClientSession | None = None
        self.agent_state = "off" if not self.sources.has_agents else "unknown"
        self._started = time.monotonic()
        self._waiting_said = False
        # Gateways whose admin API failed (said once per outage).
        self._gateway_down: set[str] = set()
        self._gateway_answered: set[str] = set()
        self.engine_last: dict[str, Any] = {}  # the last window of each engine's metrics
        self._engine_reads = FilteredReads(ENGINE_METRICS_PATH)
        self._probing: set[str] = set()
        # Per endpoint: seconds of decoding the live agent has reported no CUDA calls for (a
        # process it cannot name), and whether that was said.
        self._uncovered: dict[str, tuple[float, bool]] = {}

    # -- lifecycle ----------------------------------------------------------------------------
    def open(self) -> None:
        """The HTTP session of every read (called inside the running loop)."""
        self.session = aiohttp.ClientSession(
            # Generous: a busy agent or engine answering late stretches one window; a timeout
            # would lose the signal for it (and flap the agent's state).
            timeout=aiohttp.ClientTimeout(total=max(1.0, self.s.interval_s * 4)),
            connector=aiohttp.TCPConnector(limit=64),
        )

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
        for a in self._admins.values():
            await a.close()

    def admin(self, url: str) -> GatewayAdmin:
        """The admin client of a gateway replica, kept across windows."""
        a = self._admins.get(url)
        if a is None:
            a = self._admins[url] = GatewayAdmin(url, self.cfg.admin_token, timeout=2.0)
        return a

    def forget(self, name: str) -> None:
        """An endpoint no gateway lists any more."""
        self._uncovered.pop(name, None)
        self._engine_deltas.pop(name, None)
        self.engine_last.pop(name, None)

    # -- reading ------------------------------------------------------------------------------
    async def _get(self, url: str) -> str:
        assert self.session is not None
        async with self.session.get(url) as r:
            if r.status != 200:
                raise aiohttp.ClientResponseError(r.request_info, (), status=r.status)
            return await r.text()

    async def read_agent(self) -> dict[str, Any] | None:
        """Every agent's windows, merged by endpoint (each node's agent sees its own)."""
        urls = self.sources.agents
        if not urls:
            if self.sources.has_agents:
                self._agent_now("unreachable", "no agent endpoints discovered yet")
            return None
        texts = await asyncio.gather(
            *(self._get(u + "/metrics") for u in urls), return_exceptions=True
        )
        merged: dict[str, Any] = {}
        live, errors = 0, []
        for url, text in zip(urls, texts, strict=True):
            if isinstance(text, BaseException):
                self.metrics.errors.labels("agent").inc()
                errors.append(f"{url}: {text}")
                continue
            windows, ebpf = agent_windows(
                text, self._agent_deltas.setdefault(url, HistogramDelta())
            )
            if not ebpf:
                continue
            live += 1
            for ep, w in windows.items():
                merged[ep] = merged[ep].merge(w) if ep in merged else w
        if live:
            self._agent_now("live", f"reading CUDA call latency from {live} agent(s): {urls}")
            return merged
        if errors:
            self._agent_now("unreachable", "agent unreachable: " + "; ".join(errors))
        else:
            self._agent_now(
                "no-ebpf", "the agent runs without eBPF (not root or no BTF): no CUDA signal"
            )
        return None

    async def read_gateways(self) -> dict[str, EndpointView] | None:
        """Every gateway's listing. Endpoints are the union; in-flight and slow clients are
        summed over the replicas (each holds its own share of the streams)."""
        urls = self.sources.gateways
        listings, routes = await asyncio.gather(
            asyncio.gather(*(self.admin(u).endpoints() for u in urls), return_exceptions=True),
            asyncio.gather(*(self.admin(u).routes() for u in urls), return_exceptions=True),
        )
        merged: dict[str, EndpointView] = {}
        self.gateway_views = {}
        self.gateway_routes = {}
        self.listed_any = set()
        for url, listing, rts in zip(urls, listings, routes, strict=True):
            if isinstance(listing, BaseException):
                self.metrics.errors.labels("gateway").inc()
                self._gateway_failed(url, listing)
                continue
            if isinstance(rts, dict) and isinstance(rts.get("override"), dict):
                self.gateway_routes[url] = rts["override"]
            self.listed_any.update(str(d.get("name")) for d in listing)
            if url in self._gateway_down:
                self._gateway_down.discard(url)
                log.info("gateway admin %s answers again", url)
            self._gateway_answered.add(url)
            mine = {
                v.name: v
                for v in map(EndpointView.from_admin, listing)
                if v.state in ("ready", "draining")
            }
            self.gateway_views[url] = mine
            for name, v in mine.items():
                if name not in merged:
                    merged[name] = replace(v)
                else:
                    m = merged[name]
                    m.inflight += v.inflight
                    m.slow_clients += v.slow_clients
        for gone in set(self._admins) - set(urls):
            await self._admins.pop(gone).close()
            self.on_gateway_gone(gone)
        return merged if self.gateway_views else None

    def _gateway_failed(self, url: str, e: BaseException) -> None:
        """Say once per outage that a gateway cannot be read: without its listing nothing is
        classified or applied there. A gateway started beside the controller (`unbroken up`)
        gets the agent's grace before its first answer."""
        why = str(e) or type(e).__name__
        if isinstance(e, AdminRejected) and e.status in (401, 403):
            why = f"{why} (is the admin token the gateway's?)"
        if (
            url not in self._gateway_answered
            and time.monotonic() - self._started < AGENT_START_GRACE_S
            and not isinstance(e, AdminRejected)
        ):
            log.debug("gateway admin %s not answering yet: %s", url, why)
            return
        if url not in self._gateway_down:
            log.warning(
                "gateway admin %s unreadable: %s; nothing is classified or changed there until "
                "it answers",
                url,
                why,
            )
        self._gateway_down.add(url)

    def _agent_now(self, state: str, message: str) -> None:
        if (
            state == "unreachable"
            and self.agent_state == "unknown"
            and time.monotonic() - self._started < AGENT_START_GRACE_S
        ):
            # Not an outage yet: the agent has never answered and is likely still starting.
            if not self._waiting_said:
                log.info("waiting for the agent to listen: %s", message.split(": ", 1)[-1])
                self._waiting_said = True
            self.metrics.agent_live.set(0)
            return
        if state != self.agent_state:
            (log.info if state == "live" else log.warning)(
                "%s%s",
                message,
                "" if state == "live" else "; judging endpoints by engine and gateway signals",
            )
            self.agent_state = state
        self.metrics.agent_live.set(1 if state == "live" else 0)

    async def read_engine(self, v: EndpointView) -> Any:
        """The engine's own metrics over the last window, None when unreadable."""
        deltas = self._engine_deltas.setdefault(v.name, HistogramDelta())
        try:
            text = await self._engine_reads.read(v.url, lambda path: self._get(v.url + path))
            return engine_window(text or "", deltas)
        except (aiohttp.ClientError, TimeoutError, OSError):
            self.metrics.errors.labels("engine").inc()
            return None

    def probe(self, v: EndpointView) -> None:
        """A contended endpoint gets little or no traffic (it was routed around), so it may
        produce no signal to show it recovered; a suspect one (one slow window) may have lost
        its traffic to the gateway's own load balancing before the dwell could confirm it.
        Send it one small greedy completion directly, at most one at a time, to make it run
        decode steps the signals can measure."""
        if v.name in self._probing or not v.models or self.session is None:
            return
        self._probing.add(v.name)
        body = {
            "model": v.models[0],
            "prompt": "unbroken controller probe",
            "max_tokens": 16,
            "temperature": 0,
        }

        async def go() -> None:
            assert self.session is not None
            try:
                async with self.session.post(
                    v.url + "/v1/completions",
                    json=body,
                    headers={"X-Request-Id": f"unbroken-probe-{v.name}"},
                    timeout=aiohttp.ClientTimeout(total=30),
                ) as r:
                    await r.read()
                    self.metrics.probes.labels("ok" if r.status == 200 else "error").inc()
            except (aiohttp.ClientError, TimeoutError, OSError):
                self.metrics.probes.labels("error").inc()
            finally:
                self._probing.discard(v.name)

        self._spawn(go())

    def coverage(self, name: str, covered: bool, ew: Any, agent: dict[str, Any]) -> None:
        """Say once when a live agent has reported no CUDA calls for an endpoint over 5 s of
        its decoding (the controller then judges it by the engine's ITL, slower to show
        contention), and again when they come."""
        uncovered, said = self._uncovered.get(name, (0.0, False))
        if covered:
            if said:
                log.info("%s: CUDA calls from the agent again", name)
            self._uncovered.pop(name, None)
            return
        if ew is None or ew.itl_count < 3:
            return  # idle: no calls expected
        uncovered += self.s.interval_s
        if not said and uncovered >= UNCOVERED_S:
            log.warning(
                "%s: the agent is live but reported no CUDA calls for it over %.0f s of its "
                "decoding (endpoints the agent names: %s): judging it by the engine's ITL",
                name,
                uncovered,
                ", ".join(sorted(agent)) or "none",
            )
            said = True
        self._uncovered[name] = (uncovered, said)


def engine_state(ew: Any) -> dict[str, Any] | None:
    """The last window of an engine's own metrics, as /state shows it (informational: only
    the ITL enters decisions)."""
    if ew is None:
        return None

    def ms(x: float | None) -> float | None:
        return None if x is None else round(x * 1e3, 2)

    return {
        "running": ew.running,
        "waiting": ew.waiting,
        "kv_usage": round(ew.kv_usage, 4),
        "itl_ms": ms(ew.itl_mean),
        "ttft_ms": ms(ew.ttft_mean),
    }
