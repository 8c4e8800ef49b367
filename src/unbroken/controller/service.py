"""The controller process: a loop that reads the signals every `interval_s`, classifies each
endpoint, and acts through the gateway's admin API; plus a small HTTP server with /metrics,
/health, /state and /decisions.

It learns of contention only from measured signals (the agent's uprobe histograms, the
engines' vLLM metrics): it never asks an engine what fault it was given.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from dataclasses import replace
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from unbroken.clients import AdminError, AdminRejected, EngineAdmin, GatewayAdmin
from unbroken.controller.actions import Actuator, Decision, EndpointView
from unbroken.controller.classify import CONDITIONS, Detector, Transition
from unbroken.controller.config import ControllerConfig
from unbroken.controller.precision import Converter, PrecisionState, plan
from unbroken.controller.scaling import ScalingLoop
from unbroken.controller.signals import HistogramDelta, agent_windows, engine_window
from unbroken.controller.sources import Sources
from unbroken.wire.metrics import register_standard_metrics

__all__ = ["Controller", "ControllerConfig", "run_controller", "serve"]

log = logging.getLogger("unbroken.controller")

DETECTION_BUCKETS = (0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)
UNCOVERED_S = 5.0  # decoding seconds a live agent may be silent about before a warning
# An agent started beside the controller (`unbroken up`, a DaemonSet rolling out) takes a
# moment to listen: until it has answered once, this long passes before "unreachable" warns.
AGENT_START_GRACE_S = 10.0


class _Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        register_standard_metrics(r, "controller")
        self.condition = Gauge(
            "unbroken_controller_condition",
            "1 for the endpoint's current condition.",
            ["endpoint", "condition"],
            registry=r,
        )
        self.transitions = Counter(
            "unbroken_controller_transitions",
            "Condition changes.",
            ["endpoint", "from", "to"],
            registry=r,
        )
        self.detection = Histogram(
            "unbroken_controller_detection_latency_seconds",
            "From the first window past the enter threshold to the condition change "
            "(the onset-to-action latency is measured by benchmarks/controller.py).",
            buckets=DETECTION_BUCKETS,
            registry=r,
        )
        self.ratio = Gauge(
            "unbroken_controller_signal_ratio",
            "Last window's signal over the endpoint's learned baseline.",
            ["endpoint", "source"],
            registry=r,
        )
        self.baseline = Gauge(
            "unbroken_controller_baseline_seconds",
            "Learned baseline of the signal the endpoint is judged by.",
            ["endpoint", "source"],
            registry=r,
        )
        self.slow_clients = Gauge(
            "unbroken_controller_slow_clients",
            "Streams whose client reads slower than the engine writes (reported, not acted on).",
            ["endpoint"],
            registry=r,
        )
        self.actions = Counter(
            "unbroken_controller_actions",
            "Actions applied through admin APIs.",
            ["action"],
            registry=r,
        )
        for a in (
            "lower cap",
            "raise cap",
            "restore cap",
            "route to degraded",
            "restore routes",
            "move streams",
            "convert",
            "convert back",
        ):
            self.actions.labels(a)
        self.poll = Histogram(
            "unbroken_controller_poll_seconds",
            "Time to read every signal once.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
            registry=r,
        )
        self.agent_live = Gauge(
            "unbroken_controller_agent_live",
            "1 while the agent's eBPF signals are being read.",
            registry=r,
        )
        self.errors = Counter(
            "unbroken_controller_read_errors",
            "Signal reads that failed, by source.",
            ["source"],
            registry=r,
        )
        for s in ("gateway", "agent", "engine", "apply"):
            self.errors.labels(s)
        self.probes = Counter(
            "unbroken_controller_probes",
            "Small completions sent straight to a routed-around endpoint to measure it.",
            ["result"],
            registry=r,
        )
        for s in ("ok", "error"):
            self.probes.labels(s)


class Controller:
    def __init__(self, cfg: ControllerConfig) -> None:
        self.cfg = cfg
        self.s = cfg.settings
        self.sources = Sources(
            cfg.admin_urls,
            cfg.agent_urls,
            gateway_service=cfg.gateway_service,
            agent_service=cfg.agent_service,
        )
        self._admins: dict[str, GatewayAdmin] = {}
        # What each gateway listed last window: name → view (to apply only what differs).
        self._gateway_views: dict[str, dict[str, EndpointView]] = {}
        self.actuator = Actuator(self.s, cfg.tiers)
        self.detectors: dict[str, Detector] = {}
        self.views: dict[str, EndpointView] = {}
        self.decisions: collections.deque[Decision] = collections.deque(maxlen=2000)
        self.metrics = _Metrics()
        self._agent_deltas: dict[str, HistogramDelta] = {}
        self._engine_deltas: dict[str, HistogramDelta] = {}
        self._session: aiohttp.ClientSession | None = None
        self.agent_state = "off" if not self.sources.has_agents else "unknown"
        self._started = time.monotonic()
        self._waiting_said = False
        # Gateways whose admin API failed (said once per outage).
        self._gateway_down: set[str] = set()
        self._gateway_answered: set[str] = set()
        # The engine-side twin of the cap, per engine it lowered: (max_num_seqs before, the
        # cap last applied); and engines without an admin API to do it.
        self._engine_capped: dict[str, tuple[int, int]] = {}
        self._engine_no_admin: set[str] = set()
        self._engine_last: dict[str, Any] = {}  # the last window of each engine's metrics
        self._routes_applied: dict[str, dict[str, list[str]]] = {}  # per gateway
        self._routes_wanted: dict[str, list[str]] | None = None
        self._moved: set[str] = set()  # endpoints whose streams were moved this episode
        self._stop = asyncio.Event()
        self.polls = 0
        self._probing: set[str] = set()
        # Per endpoint: seconds of decoding the live agent has reported no CUDA calls for (a
        # process it cannot name), and whether that was said.
        self._uncovered: dict[str, tuple[float, bool]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.precision = PrecisionState()
        self._converting: str | None = None
        self.converter = (
            Converter(cfg.supervisor_socket)
            if cfg.supervisor_socket and self.s.convert_after_s is not None
            else None
        )
        # Autoscaling of `replicas: {min, max}` pools (controller/scaling.py): under
        # `unbroken up` only; on Kubernetes KEDA or the HPA scale on the same signal.
        self.scaling = (
            ScalingLoop(
                cfg.supervisor_socket,
                lambda: self.sources.gateways,
                cfg.admin_token,
                self.metrics.registry,
                self._record,
                self._contended_by_pool,
                lambda pool: self.s.min_full_replicas if pool in cfg.tiers.full else 0,
            )
            if cfg.supervisor_socket
            else None
        )

    def _contended_by_pool(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for name, d in self.detectors.items():
            v = self.views.get(name)
            if v is not None and d.condition == "contended":
                out[v.pool] = out.get(v.pool, 0) + 1
        return out

    # -- reading ------------------------------------------------------------------------------
    async def _get(self, url: str) -> str:
        assert self._session is not None
        async with self._session.get(url) as r:
            if r.status != 200:
                raise aiohttp.ClientResponseError(r.request_info, (), status=r.status)
            return await r.text()

    async def _read_agent(self) -> dict[str, Any] | None:
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

    def _admin(self, url: str) -> GatewayAdmin:
        a = self._admins.get(url)
        if a is None:
            a = self._admins[url] = GatewayAdmin(url, self.cfg.admin_token, timeout=2.0)
        return a

    async def _read_gateways(self) -> dict[str, EndpointView] | None:
        """Every gateway's listing. Endpoints are the union; in-flight and slow clients are
        summed over the replicas (each holds its own share of the streams)."""
        urls = self.sources.gateways
        listings = await asyncio.gather(
            *(self._admin(u).endpoints() for u in urls), return_exceptions=True
        )
        merged: dict[str, EndpointView] = {}
        self._gateway_views = {}
        for url, listing in zip(urls, listings, strict=True):
            if isinstance(listing, BaseException):
                self.metrics.errors.labels("gateway").inc()
                self._gateway_failed(url, listing)
                continue
            if url in self._gateway_down:
                self._gateway_down.discard(url)
                log.info("gateway admin %s answers again", url)
            self._gateway_answered.add(url)
            mine = {
                v.name: v
                for v in map(EndpointView.from_admin, listing)
                if v.state in ("ready", "draining")
            }
            self._gateway_views[url] = mine
            for name, v in mine.items():
                if name not in merged:
                    merged[name] = replace(v)
                else:
                    m = merged[name]
                    m.inflight += v.inflight
                    m.slow_clients += v.slow_clients
        for gone in set(self._admins) - set(urls):
            await self._admins.pop(gone).close()
            self._routes_applied.pop(gone, None)
        return merged if self._gateway_views else None

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

    async def _read_engine(self, v: EndpointView) -> Any:
        deltas = self._engine_deltas.setdefault(v.name, HistogramDelta())
        try:
            return engine_window(await self._get(v.url + "/metrics"), deltas)
        except (aiohttp.ClientError, TimeoutError, OSError):
            self.metrics.errors.labels("engine").inc()
            return None

    # -- one window ---------------------------------------------------------------------------
    async def poll_once(self) -> None:
        t0 = time.monotonic()
        views = await self._read_gateways()
        if views is None:
            return
        agent, engines = await asyncio.gather(
            self._read_agent(), asyncio.gather(*(self._read_engine(v) for v in views.values()))
        )
        self.metrics.poll.observe(time.monotonic() - t0)
        self.views = views
        for gone in set(self.detectors) - set(views):
            self._forget(gone)
        mono, now = time.monotonic(), time.time()
        for v, ew in zip(views.values(), engines, strict=True):
            self._engine_last[v.name] = ew
            det = self.detectors.get(v.name)
            if det is None:
                det = self.detectors[v.name] = Detector(v.name, self.s, since=mono)
            cw = (agent or {}).get(v.name)
            cuda = cw.quantile(self.s.cuda_quantile) if cw is not None and cw.count >= 3 else None
            if agent is not None:
                self._coverage(v.name, cuda is not None, ew, agent)
            win = self.s.interval_s
            reading = det.read(
                mono,
                cuda_latency=cuda,
                itl=ew.itl_mean if ew is not None and ew.itl_count >= 3 else None,
                running=ew.running if ew is not None else float(v.inflight),
                backpressure=(cw.backpressure_s / win) if cw is not None else 0.0,
            )
            if reading.ratio is not None and reading.source is not None:
                self.metrics.ratio.labels(v.name, reading.source).set(reading.ratio)
            if reading.baseline is not None and reading.source is not None:
                self.metrics.baseline.labels(v.name, reading.source).set(reading.baseline)
            self.metrics.slow_clients.labels(v.name).set(v.slow_clients)
            if reading.ratio is None and (det.condition != "normal" or det.suspect):
                self._probe(v)
            tr = det.step(reading)
            if tr is not None:
                self._transition(tr, v, reading.running, now)
            if det.condition == "recovering":
                decisions, restored = self.actuator.step_up(v.name, v, mono, now)
                self._record(decisions)
                if restored and (tr2 := det.recovered(mono)) is not None:
                    self._transition(tr2, v, reading.running, now)
        await self._apply(now)
        self._maybe_convert(mono, now)
        self.polls += 1

    def _maybe_convert(self, mono: float, now: float) -> None:
        if self.converter is None:
            return
        if any(
            d.condition == "contended" and self.views.get(n, None) is not None
            and self.views[n].pool in self.cfg.tiers.full
            for n, d in self.detectors.items()
        ):  # fmt: skip
            self.precision.last_contended = mono  # also while a conversion runs
        if self._converting is not None:
            return
        p = plan(
            self.s,
            self.precision,
            mono,
            full=self.cfg.tiers.full,
            degraded=self.cfg.tiers.degraded,
            conditions={n: (d.condition, d.since) for n, d in self.detectors.items()},
            pools={n: v.pool for n, v in self.views.items() if v.state == "ready"},
        )
        if p is None:
            return
        action = "convert back" if p.back else "convert"
        self._record([Decision(now, p.endpoint, f"{action} to {p.to_pool}", p.reason)])
        self._converting = p.endpoint
        converter = self.converter
        source = self.views[p.endpoint].pool if p.endpoint in self.views else ""

        async def go() -> None:
            try:
                res = await converter.convert(p.endpoint, p.to_pool)
            except (aiohttp.ClientError, TimeoutError, OSError) as e:
                res = {"ok": False, "error": f"supervisor unreachable: {e}"}
            finally:
                self._converting = None
            if res.get("ok"):
                # The quiet period before converting back starts now, not at the last
                # contended window before the conversion (which took seconds).
                self.precision.last_contended = time.monotonic()
                self.precision.last_conversion = time.monotonic()
                if p.back:
                    self.precision.converted.pop(p.endpoint, None)
                else:
                    self.precision.converted[res["new"]] = source
                self.metrics.actions.labels(action).inc()
                self._record(
                    [
                        Decision(
                            time.time(),
                            p.endpoint,
                            f"{action} done",
                            f"{p.endpoint} -> {res.get('new')} in {p.to_pool} after "
                            f"{res.get('seconds')} s",
                            {"result": res},
                        )
                    ]
                )
            else:
                self._record(
                    [Decision(time.time(), p.endpoint, f"{action} failed", str(res.get("error")))]
                )

        t = asyncio.create_task(go())
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def _probe(self, v: EndpointView) -> None:
        """A contended endpoint gets little or no traffic (it was routed around), so it may
        produce no signal to show it recovered; a suspect one (one slow window) may have lost
        its traffic to the gateway's own load balancing before the dwell could confirm it.
        Send it one small greedy completion directly, at most one at a time, to make it run
        decode steps the signals can measure."""
        if v.name in self._probing or not v.models or self._session is None:
            return
        self._probing.add(v.name)
        body = {
            "model": v.models[0],
            "prompt": "unbroken controller probe",
            "max_tokens": 16,
            "temperature": 0,
        }

        async def go() -> None:
            assert self._session is not None
            try:
                async with self._session.post(
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

        t = asyncio.create_task(go())
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def _transition(self, tr: Transition, v: EndpointView, running: float, now: float) -> None:
        self.metrics.transitions.labels(tr.endpoint, tr.old, tr.new).inc()
        if tr.detection_s is not None:
            self.metrics.detection.observe(tr.detection_s)
        self._record(self.actuator.on_transition(tr, v, running, now))

    def _record(self, decisions: list[Decision]) -> None:
        for d in decisions:
            self.decisions.append(d)
            if d.action in ("lower cap", "raise cap", "restore cap"):
                self.metrics.actions.labels(d.action).inc()
            log.info("%s: %s (%s)", d.endpoint, d.action, d.reason)

    def _coverage(self, name: str, covered: bool, ew: Any, agent: dict[str, Any]) -> None:
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

    def _forget(self, name: str) -> None:
        self._uncovered.pop(name, None)
        self.detectors.pop(name, None)
        self._engine_deltas.pop(name, None)
        self.actuator.caps.pop(name, None)
        self._engine_capped.pop(name, None)
        self._engine_last.pop(name, None)
        self._engine_no_admin.discard(name)
        for c in CONDITIONS:
            try:
                self.metrics.condition.remove(name, c)
            except KeyError:
                pass

    # -- acting -------------------------------------------------------------------------------
    async def _apply(self, now: float) -> None:
        """Make every gateway match what we want: condition and cap override per endpoint,
        and the routes override. Compared with what each gateway reports, so a restarted (or
        new) gateway replica is brought in line on the next window."""
        for name, det in self.detectors.items():
            for c in CONDITIONS:
                self.metrics.condition.labels(name, c).set(1 if det.condition == c else 0)
        for url, views in self._gateway_views.items():
            for name, v in views.items():
                det = self.detectors.get(name)
                if det is None:
                    continue
                want_cap = self.actuator.caps.get(name)
                patch: dict[str, Any] = {}
                if v.condition != det.condition:
                    patch["condition"] = det.condition
                if v.cap_override != want_cap:
                    patch["cap_override"] = want_cap
                if patch:
                    try:
                        await self._admin(url).patch(name=name, **patch)
                    except AdminError as e:
                        self.metrics.errors.labels("apply").inc()
                        log.warning("could not update %s on the gateway %s: %s", name, url, e)
        conditions = {n: d.condition for n, d in self.detectors.items()}
        pools = {n: v.pool for n, v in self.views.items()}
        want = self.actuator.routes(conditions, pools)
        await self._apply_routes(want, now)
        await self._move_streams(now)
        await self._apply_engine_caps(now)

    async def _apply_engine_caps(self, now: float) -> None:
        """Where an engine has an admin API (the simulator's `POST /admin/config`), its
        max_num_seqs follows the gateway's lowered cap and comes back with it, so that work
        reaching it by other ways (another gateway, direct clients) is bounded too. vLLM has
        no such call (404): said once per endpoint; the gateway's cap then stands alone."""
        token = self.cfg.engine_token
        if not token:
            return
        for name, v in self.views.items():
            want = self.actuator.caps.get(name)
            capped = self._engine_capped.get(name)
            if name in self._engine_no_admin or (capped[1] if capped else None) == want:
                continue  # as wanted already (never lowered and nothing to lower included)
            try:
                async with EngineAdmin(v.url, token, timeout=2.0) as eng:
                    orig = capped[0] if capped else int((await eng.config())["max_num_seqs"])
                    target = orig if want is None else min(want, orig)
                    await eng.set_max_num_seqs(max_num_seqs=target)
            except (AdminError, KeyError, TypeError, ValueError) as e:
                no_api = isinstance(e, AdminRejected) and e.status in (401, 403, 404, 405)
                if not no_api:
                    self.metrics.errors.labels("apply").inc()
                    log.warning("could not set max_num_seqs on %s: %s", name, e)
                    continue  # retried next window
                self._engine_no_admin.add(name)
                denied = isinstance(e, AdminRejected) and e.status in (401, 403)
                (log.warning if denied else log.info)(
                    "%s: max_num_seqs not changed on the engine (%s%s); the gateway's cap "
                    "bounds it alone",
                    name,
                    e,
                    ": is the engine token its own?" if denied else "",
                )
                continue
            if want is None:
                del self._engine_capped[name]
            else:
                self._engine_capped[name] = (orig, want)
            why = (
                f"restored to {target}"
                if want is None
                else f"follows the gateway cap: {target} (was {orig})"
            )
            data = {"max_num_seqs": target}
            self._record([Decision(now, name, "engine max_num_seqs", why, data)])

    async def _move_streams(self, now: float) -> None:
        """Once per episode, after the routes moved: the contended endpoint's running
        standard and sheddable streams continue elsewhere (by continuation, byte-exact),
        instead of stalling on the slow device until they end."""
        for name, det in self.detectors.items():
            if det.condition != "contended":
                self._moved.discard(name)
                continue
            if not self.s.move_streams or name in self._moved:
                continue
            self._moved.add(name)
            prios = ["standard", "sheddable"]
            moving: list[Any] = []
            for url in self._gateway_views:
                try:
                    r = await self._admin(url).rebalance(
                        name=name,
                        priorities=prios,
                        batch=self.s.move_batch,
                        every_s=self.s.move_every_s,
                    )
                    moving.append(r.get("moving"))
                except AdminError as e:
                    self.metrics.errors.labels("apply").inc()
                    log.warning("could not move streams off %s on %s: %s", name, url, e)
            self.metrics.actions.labels("move streams").inc()
            known = [m for m in moving if isinstance(m, int)]
            count = f"{sum(known)} stream(s)" if len(known) == len(moving) else "streams"
            self._record(
                [
                    Decision(
                        now,
                        name,
                        "move streams",
                        f"contended: {count} of priority {'/'.join(prios)} continue "
                        "elsewhere; critical streams stay",
                        {"moving": moving},
                    )
                ]
            )

    async def _apply_routes(self, want: dict[str, list[str]], now: float) -> None:
        for url in self._gateway_views:
            if self._routes_applied.get(url) == want:
                continue
            try:
                if want:
                    await self._admin(url).set_routes_override(routes=want)
                else:
                    await self._admin(url).clear_routes_override()
                self._routes_applied[url] = want
            except AdminError as e:
                self.metrics.errors.labels("apply").inc()
                log.warning("could not update the routes of the gateway %s: %s", url, e)
        if want == self._routes_wanted or (not want and self._routes_wanted is None):
            self._routes_wanted = want
            return
        self._routes_wanted = want
        if want:
            self.metrics.actions.labels("route to degraded").inc()
            self._record(
                [
                    Decision(
                        now,
                        "*",
                        "route to degraded",
                        "a full-precision endpoint is contended: critical stays on "
                        f"{', '.join(self.cfg.tiers.full)}; standard and sheddable go to "
                        f"{', '.join(self.cfg.tiers.degraded)} first",
                        {"routes": want},
                    )
                ]
            )
        else:
            self.metrics.actions.labels("restore routes").inc()
            self._record(
                [Decision(now, "*", "restore routes", "no full-precision endpoint is contended")]
            )

    # -- lifecycle ----------------------------------------------------------------------------
    async def run(self) -> None:
        self._session = aiohttp.ClientSession(
            # Generous: a busy agent or engine answering late stretches one window; a timeout
            # would lose the signal for it (and flap the agent's state).
            timeout=aiohttp.ClientTimeout(total=max(1.0, self.s.interval_s * 4)),
            connector=aiohttp.TCPConnector(limit=64),
        )
        log.info(
            "controller: every %.0f ms; tiers full=%s degraded=%s; %s",
            self.s.interval_s * 1e3,
            ",".join(self.cfg.tiers.full) or "-",
            ",".join(self.cfg.tiers.degraded) or "-",
            self.sources.describe(),
        )
        if not self.sources.has_agents:
            log.warning("no agent configured: judging endpoints by engine and gateway signals")
        self.sources.start()
        if self.scaling is not None:
            t = asyncio.create_task(self.scaling.run(self._stop), name="autoscaler")
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)
        try:
            next_t = time.monotonic()
            while not self._stop.is_set():
                try:
                    await self.poll_once()
                except Exception:  # one bad window must not end the loop
                    log.exception("controller window failed")
                next_t += self.s.interval_s
                delay = next_t - time.monotonic()
                if delay < 0:  # fell behind: skip, don't burst
                    next_t, delay = time.monotonic(), 0
                try:
                    await asyncio.wait_for(self._stop.wait(), delay)
                except TimeoutError:
                    pass
        finally:
            for t in list(self._tasks):
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self.sources.stop()
            await self._session.close()
            for a in self._admins.values():
                await a.close()

    def stop(self) -> None:
        self._stop.set()

    def state(self) -> dict[str, Any]:
        eps = {}
        for name, d in self.detectors.items():
            r = d.last
            eps[name] = {
                "condition": d.condition,
                "pool": self.views[name].pool if name in self.views else None,
                "source": r.source if r else None,
                "ratio": None if r is None or r.ratio is None else round(r.ratio, 3),
                "signal_s": None if r is None else r.value,
                "baseline_s": None if r is None else r.baseline,
                "backpressure": None if r is None else round(r.backpressure, 3),
                "cap_override": self.actuator.caps.get(name),
                "engine_max_num_seqs": c[1] if (c := self._engine_capped.get(name)) else None,
                "slow_clients": self.views[name].slow_clients if name in self.views else 0,
                "engine": _engine_state(self._engine_last.get(name)),
            }
        return {
            "agent": self.agent_state,
            "autoscale": self.scaling.last if self.scaling is not None else None,
            "interval_s": self.s.interval_s,
            "polls": self.polls,
            "routes_override": self._routes_wanted or {},
            "gateways": self.sources.gateways,
            "agents": self.sources.agents,
            "endpoints": eps,
        }


def _engine_state(ew: Any) -> dict[str, Any] | None:
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


def _json(obj: Any) -> web.Response:
    return web.Response(body=orjson.dumps(obj), content_type="application/json")


def build_app(c: Controller) -> web.Application:
    app = web.Application()

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(c.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def health(request: web.Request) -> web.Response:
        return _json({"status": "ok", "agent": c.agent_state, "polls": c.polls})

    async def state(request: web.Request) -> web.Response:
        return _json(c.state())

    async def decisions(request: web.Request) -> web.Response:
        since = request.query.get("since")
        try:
            t = float(since) if since is not None else -math.inf
        except ValueError:
            from unbroken.wire.errors import ApiError

            raise ApiError(400, "since must be a unix time", param="since") from None
        return _json({"decisions": [d.as_dict() for d in c.decisions if d.t > t]})

    from unbroken.wire.http import error_middleware

    app.middlewares.append(error_middleware)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    app.router.add_get("/state", state)
    app.router.add_get("/decisions", decisions)
    return app


async def serve(cfg: ControllerConfig) -> None:
    import signal

    from unbroken.wire.heap import freeze_startup_heap
    from unbroken.wire.http import start_site

    c = Controller(cfg)
    freeze_startup_heap()
    runner = await start_site(build_app(c), cfg.settings.host, cfg.settings.port)
    log.info("controller API on http://%s:%d", cfg.settings.host, cfg.settings.port)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, c.stop)
    try:
        await c.run()
    finally:
        await runner.cleanup()


def run_controller(cfg: ControllerConfig) -> None:
    import uvloop

    uvloop.run(serve(cfg))
