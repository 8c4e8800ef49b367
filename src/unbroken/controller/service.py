"""The controller process: a loop that reads the signals every `interval_s`, classifies each
endpoint, and acts through the gateway's admin API; plus a small HTTP server with /metrics,
/health, /state and /decisions.

`Controller` is the decision loop (`poll_once`), assembled from its parts:

- `sensing.Sensing`: every read (gateways, agents, engines), probes and coverage
- `classify.Detector` per endpoint and `actions.Actuator`: the pure judgement and caps
- `reconcile.Reconciler`: conditions, caps, routes, moving streams, engine caps applied
- `precision_driver.PrecisionDriver`: dynamic precision through the supervisor
- `scaling.ScalingLoop`: the autoscaler under `unbroken up`
- `metrics.ControllerMetrics`: the series; `api`: the HTTP face, `serve`, `run_controller`

It learns of contention only from measured signals (the agent's uprobe histograms, the
engines' vLLM metrics): it never asks an engine what fault it was given.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from collections.abc import Coroutine
from typing import Any

from unbroken.controller.actions import Actuator, Decision, EndpointView
from unbroken.controller.api import build_app, run_controller, serve
from unbroken.controller.classify import CONDITIONS, Condition, Detector, Transition
from unbroken.controller.config import ControllerConfig
from unbroken.controller.metrics import DETECTION_BUCKETS, ControllerMetrics
from unbroken.controller.persist import StateStore
from unbroken.controller.precision_driver import PrecisionDriver
from unbroken.controller.reconcile import Reconciler
from unbroken.controller.scaling import ScalingLoop
from unbroken.controller.sensing import AGENT_START_GRACE_S, UNCOVERED_S, Sensing, engine_state

__all__ = [
    "AGENT_START_GRACE_S",
    "DETECTION_BUCKETS",
    "UNCOVERED_S",
    "Controller",
    "ControllerConfig",
    "build_app",
    "run_controller",
    "serve",
]

log = logging.getLogger("unbroken.controller")

# An endpoint no gateway lists is forgotten after this long (and this many windows in which
# a gateway answered): a restarted gateway's first listings may lack it.
FORGET_AFTER_S = 10.0
FORGET_AFTER_WINDOWS = 5
BASELINE_SAVE_S = 2.0  # how often learned baselines are written to `state_file`


class Controller:
    def __init__(self, cfg: ControllerConfig) -> None:
        self.cfg = cfg
        self.s = cfg.settings
        self.metrics = ControllerMetrics()
        self._tasks: set[asyncio.Task[None]] = set()
        self.sensing = Sensing(cfg, self.metrics, self._spawn)
        self.sources = self.sensing.sources
        self.actuator = Actuator(self.s, cfg.tiers)
        self.detectors: dict[str, Detector] = {}
        self.views: dict[str, EndpointView] = {}
        self.decisions: collections.deque[Decision] = collections.deque(maxlen=2000)
        self.store = StateStore(self.s.state_file)
        self.reconciler = Reconciler(
            cfg, self.actuator, self.metrics, self.sensing, self._record, self.store
        )
        self.sensing.on_gateway_gone = self.reconciler.forget_gateway
        self._stop = asyncio.Event()
        # Every endpoint judged, as last listed (also while a restarting gateway omits it),
        # and for how many windows in a row no readable gateway has listed it.
        self.known: dict[str, EndpointView] = {}
        self._missing: dict[str, int] = {}
        self.forget_after = max(FORGET_AFTER_WINDOWS, math.ceil(FORGET_AFTER_S / self.s.interval_s))
        self.polls = 0
        self._baselines_saved = 0.0
        self.precision_driver = PrecisionDriver(cfg, self.metrics, self._record, self._spawn)
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
                lambda: self.precision_driver.pools_involved(self.views),
            )
            if cfg.supervisor_socket
            else None
        )

    @property
    def agent_state(self) -> str:
        """off, unknown, live, no-ebpf or unreachable."""
        return self.sensing.agent_state

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """A background task (a probe, a conversion) that `run` cancels at its end."""
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def _contended_by_pool(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for name, d in self.detectors.items():
            v = self.views.get(name)
            if v is not None and d.condition == "contended":
                out[v.pool] = out.get(v.pool, 0) + 1
        return out

    # -- one window ---------------------------------------------------------------------------
    async def poll_once(self) -> None:
        """Read every signal, judge each endpoint, act on what changed."""
        t0 = time.monotonic()
        sense = self.sensing
        views = await sense.read_gateways()
        if views is None:
            return
        agent, engines = await asyncio.gather(
            sense.read_agent(), asyncio.gather(*(sense.read_engine(v) for v in views.values()))
        )
        self.metrics.poll.observe(time.monotonic() - t0)
        self.views = views
        self.known.update(views)
        await self._forget_gone(views)
        mono, now = time.monotonic(), time.time()
        for v, ew in zip(views.values(), engines, strict=True):
            sense.engine_last[v.name] = ew
            det = self.detectors.get(v.name)
            if det is None:
                det = self.detectors[v.name] = self._new_detector(v, mono, now)
            cw = (agent or {}).get(v.name)
            cuda = cw.quantile(self.s.cuda_quantile) if cw is not None and cw.count >= 3 else None
            if agent is not None:
                sense.coverage(v.name, cuda is not None, ew, agent)
            win = self.s.interval_s
            reading = det.read(
                mono,
                cuda_latency=cuda,
                itl=ew.itl_mean if ew is not None and ew.itl_count >= 3 else None,
                running=ew.running if ew is not None else float(v.inflight),
                backpressure=(cw.backpressure_s / win) if cw is not None else 0.0,
                # Never learn from an endpoint the gateway lists in an episode.
                learn=v.condition == "normal" and v.cap_override is None,
            )
            if reading.ratio is not None and reading.source is not None:
                self.metrics.ratio.labels(v.name, reading.source).set(reading.ratio)
            if reading.baseline is not None and reading.source is not None:
                self.metrics.baseline.labels(v.name, reading.source).set(reading.baseline)
            self.metrics.slow_clients.labels(v.name).set(v.slow_clients)
            if reading.ratio is None and (det.condition != "normal" or det.suspect):
                sense.probe(v)
            tr = det.step(reading)
            if tr is not None:
                self._transition(tr, v, reading.running, now)
            if det.condition == "recovering":
                decisions, restored = self.actuator.step_up(v.name, v, mono, now)
                self._record(decisions)
                if restored and (tr2 := det.recovered(mono)) is not None:
                    self._transition(tr2, v, reading.running, now)
        pools = {n: v.pool for n, v in self.known.items()}
        await self.reconciler.apply(self.detectors, self.views, now, pools)
        self.precision_driver.step(mono, now, self.detectors, self.views)
        self.polls += 1
        if self.store.path is not None and mono - self._baselines_saved >= BASELINE_SAVE_S:
            self._save_baselines(mono)

    def _new_detector(self, v: EndpointView, mono: float, now: float) -> Detector:
        """An endpoint this process has not judged yet (its start, or listed anew). Its
        baselines are what an earlier process learned, where `state_file` kept them. An
        endpoint the gateway lists in an episode (contended or recovering, or with a cap
        override) was acted on by an earlier process: the episode goes on from the
        gateway's cap, never cleared at once; without a baseline to judge the end by, it is
        undone step by step (recovering)."""
        det = Detector(v.name, self.s, since=mono)
        kept = self.store.baselines.get(v.name)
        restored = bool(kept) and kept.get("url") == v.url and det.load_baselines(kept)
        if v.condition not in ("contended", "recovering") and v.cap_override is None:
            return det
        judged = restored and det.has_baseline
        cond: Condition = "contended" if v.condition == "contended" and judged else "recovering"
        det.resume(cond, mono)
        self.actuator.resume(v.name, v.cap_override, cond, mono)
        if cond == "contended":
            self.reconciler.moved(v.name)  # its streams were moved when it entered
        how = (
            "judged against its kept baseline"
            if judged
            else "no baseline kept to judge it by: undone step by step"
        )
        self._record(
            [
                Decision(
                    now,
                    v.name,
                    "resume episode",
                    f"the gateway lists it {v.condition} with cap override {v.cap_override}: "
                    f"resumed as {cond}, {how}",
                    {"cap": v.cap_override, "condition": cond},
                )
            ]
        )
        return det

    def _save_baselines(self, mono: float) -> None:
        self._baselines_saved = mono
        for name, det in self.detectors.items():
            v = self.views.get(name)
            if v is not None and det.has_baseline:
                self.store.baselines[name] = {"url": v.url, **det.baselines()}
        self.store.save()

    def _transition(self, tr: Transition, v: EndpointView, running: float, now: float) -> None:
        self.metrics.transitions.labels(tr.endpoint, tr.old, tr.new).inc()
        if tr.detection_s is not None:
            self.metrics.detection.observe(tr.detection_s)
        self._record(self.actuator.on_transition(tr, v, running, now))
        if tr.new == "contended" and self.store.path is not None:
            self._save_baselines(time.monotonic())  # what a restart mid-episode judges by

    def _record(self, decisions: list[Decision]) -> None:
        for d in decisions:
            self.decisions.append(d)
            if d.action in ("lower cap", "raise cap", "restore cap"):
                self.metrics.actions.labels(d.action).inc()
            log.info("%s: %s (%s)", d.endpoint, d.action, d.reason)

    async def _forget_gone(self, views: dict[str, EndpointView]) -> None:
        """Forget an endpoint only once no readable gateway has listed it, in any state, for
        `forget_after` windows in a row: a restarted gateway lists none or some at first
        (or lists them before their health checks pass), and forgetting at once dropped
        the episode's condition, cap and lowered engine."""
        for name in list(self.detectors):
            if name in views or name in self.sensing.listed_any:
                self._missing.pop(name, None)
                continue
            n = self._missing[name] = self._missing.get(name, 0) + 1
            if n >= self.forget_after:
                await self._forget(name, self.known.get(name))

    async def _forget(self, name: str, view: EndpointView | None) -> None:
        det = self.detectors.get(name)
        if det is not None and det.condition != "normal":
            self._record(
                [
                    Decision(
                        time.time(),
                        name,
                        "forget endpoint",
                        f"removed from the gateway while {det.condition} (cap override "
                        f"{self.actuator.caps.get(name)}): its episode ends with it",
                    )
                ]
            )
        self._missing.pop(name, None)
        self.known.pop(name, None)
        self.sensing.forget(name)
        await self.reconciler.forget(name, view)
        self.detectors.pop(name, None)
        self.actuator.caps.pop(name, None)
        for c in CONDITIONS:
            try:
                self.metrics.condition.remove(name, c)
            except KeyError:
                pass

    # -- lifecycle ----------------------------------------------------------------------------
    async def run(self) -> None:
        """Windows every `interval_s` until `stop`; one failed window does not end it."""
        self.sensing.open()
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
            await self.sensing.close()

    def stop(self) -> None:
        self._stop.set()

    def state(self) -> dict[str, Any]:
        """What /state shows: each endpoint's condition, signal, caps and engine window."""
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
                "engine_max_num_seqs": self.reconciler.engine_cap(name),
                "slow_clients": self.views[name].slow_clients if name in self.views else 0,
                "engine": engine_state(self.sensing.engine_last.get(name)),
            }
        return {
            "agent": self.agent_state,
            "autoscale": self.scaling.last if self.scaling is not None else None,
            "interval_s": self.s.interval_s,
            "polls": self.polls,
            "routes_override": self.reconciler.routes_wanted or {},
            "gateways": self.sources.gateways,
            "agents": self.sources.agents,
            "endpoints": eps,
        }
