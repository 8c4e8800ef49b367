"""Making the gateways (and engines) match what the controller wants, every window: each
endpoint's condition and cap override on every gateway replica, the routes override (tier
routing), moving a contended endpoint's streams once per episode, and the engine-side twin
of the cap (max_num_seqs, where the engine has an admin API). Compared with what each gateway
reported, so a restarted or new replica is brought in line on the next window; undoing is
clearing an override."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from unbroken.clients import AdminError, AdminRejected, EngineAdmin
from unbroken.controller.actions import Actuator, Decision, EndpointView
from unbroken.controller.classify import CONDITIONS, Detector
from unbroken.controller.config import ControllerConfig
from unbroken.controller.metrics import ControllerMetrics
from unbroken.controller.persist import StateStore
from unbroken.controller.sensing import Sensing

__all__ = ["Reconciler"]

log = logging.getLogger("unbroken.controller")


class Reconciler:
    """What was applied where, so that only what differs is sent."""

    def __init__(
        self,
        cfg: ControllerConfig,
        actuator: Actuator,
        metrics: ControllerMetrics,
        sensing: Sensing,
        record: Callable[[list[Decision]], None],
        store: StateStore | None = None,
    ) -> None:
        self.cfg = cfg
        self.s = cfg.settings
        self.actuator = actuator
        self.metrics = metrics
        self.sensing = sensing
        self._record = record
        self.store = store if store is not None else StateStore(None)
        # The engine-side twin of the cap, per engine it lowered: (max_num_seqs before, the
        # cap last applied); and engines without an admin API to do it.
        self._engine_capped: dict[str, tuple[int, int]] = {}
        self._engine_no_admin: set[str] = set()
        # Endpoints whose engine's max_num_seqs was read since this process first saw them:
        # the memory above is lost with the process, so what the engine runs with is
        # compared with its original once (a restarted controller finds it still lowered).
        self._engine_checked: set[str] = set()
        self._routes_applied: dict[str, dict[str, list[str]]] = {}  # per gateway
        self.routes_wanted: dict[str, list[str]] | None = None
        self._moved: set[str] = set()  # endpoints whose streams were moved this episode

    def engine_cap(self, name: str) -> int | None:
        """The max_num_seqs last set on the endpoint's engine, None when not lowered."""
        return c[1] if (c := self._engine_capped.get(name)) else None

    def moved(self, name: str) -> None:
        """The endpoint's streams were moved this episode already (an earlier process)."""
        self._moved.add(name)

    def original(self, v: EndpointView) -> int | None:
        """The engine's max_num_seqs before any lowering, known from outside this process:
        the pool's configured value (the supervisor's settings), else what a previous run
        of the controller recorded before lowering it. None: unknown (read it)."""
        configured = self.s.engine_max_num_seqs.get(v.pool)
        return configured if configured is not None else self.store.engines.get(v.url)

    async def forget(self, name: str, view: EndpointView | None) -> None:
        """An endpoint no gateway lists any more: a lowered engine is restored first, while
        it still answers (it may be listed again, or serve other clients)."""
        capped = self._engine_capped.pop(name, None)
        self._engine_no_admin.discard(name)
        self._engine_checked.discard(name)
        token = self.cfg.engine_token
        if capped is None or view is None or not token:
            return
        try:
            async with EngineAdmin(view.url, token, timeout=2.0) as eng:
                await eng.set_max_num_seqs(max_num_seqs=capped[0])
        except AdminError as e:
            log.warning("%s: removed with max_num_seqs lowered, not restored: %s", name, e)
            return
        self.store.engines.pop(view.url, None)
        self.store.save()
        self.metrics.actions.labels("engine max_num_seqs").inc()
        self._record(
            [
                Decision(
                    time.time(),
                    name,
                    "engine max_num_seqs",
                    f"removed from the gateway: restored to {capped[0]}",
                    {"max_num_seqs": capped[0]},
                )
            ]
        )

    def forget_gateway(self, url: str) -> None:
        """A gateway replica discovery no longer lists."""
        self._routes_applied.pop(url, None)

    async def apply(
        self,
        detectors: Mapping[str, Detector],
        views: Mapping[str, EndpointView],
        now: float,
        pools: Mapping[str, str] | None = None,
    ) -> None:
        """Make every gateway match what we want: condition and cap override per endpoint,
        and the routes override. Compared with what each gateway reports, so a restarted (or
        new) gateway replica is brought in line on the next window."""
        for name, det in detectors.items():
            for c in CONDITIONS:
                self.metrics.condition.labels(name, c).set(1 if det.condition == c else 0)
        for url, gw_views in self.sensing.gateway_views.items():
            for name, v in gw_views.items():
                det = detectors.get(name)
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
                        await self.sensing.admin(url).patch(name=name, **patch)
                    except AdminError as e:
                        self.metrics.errors.labels("apply").inc()
                        log.warning("could not update %s on the gateway %s: %s", name, url, e)
        conditions = {n: d.condition for n, d in detectors.items()}
        # Pools of endpoints missing from this window's listing too (a restarting gateway):
        # their episode still holds the routes.
        pools = {**(pools or {}), **{n: v.pool for n, v in views.items()}}
        want = self.actuator.routes(conditions, pools)
        await self._apply_routes(want, now)
        await self._move_streams(detectors, now)
        await self._apply_engine_caps(views, now)

    async def _apply_engine_caps(self, views: Mapping[str, EndpointView], now: float) -> None:
        """Where an engine has an admin API (the simulator's `POST /admin/config`), its
        max_num_seqs follows the gateway's lowered cap and comes back with it, so that work
        reaching it by other ways (another gateway, direct clients) is bounded too. vLLM has
        no such call (404): said once per endpoint; the gateway's cap then stands alone."""
        token = self.cfg.engine_token
        if not token:
            return
        for name, v in views.items():
            want = self.actuator.caps.get(name)
            capped = self._engine_capped.get(name)
            checked = name in self._engine_checked
            if name in self._engine_no_admin or (
                checked and (capped[1] if capped else None) == want
            ):
                continue  # as wanted already (never lowered and nothing to lower included)
            try:
                async with EngineAdmin(v.url, token, timeout=2.0) as eng:
                    orig = capped[0] if capped else self.original(v)
                    current: int | None = None
                    if not checked or orig is None:
                        current = int((await eng.config())["max_num_seqs"])
                    self._engine_checked.add(name)
                    orig = orig if orig is not None else current
                    assert orig is not None
                    target = orig if want is None else min(want, orig)
                    if current != target:
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
                self._engine_capped.pop(name, None)
                if self.store.engines.pop(v.url, None) is not None:
                    self.store.save()
            else:
                self._engine_capped[name] = (orig, want)
                if self.store.engines.get(v.url) != orig:
                    self.store.engines[v.url] = orig
                    self.store.save()
            if current == target:
                continue  # found as wanted (first look since start): nothing changed
            why = (
                f"restored to {target}"
                if want is None
                else f"follows the gateway cap: {target} (was {orig})"
            )
            if want is None and capped is None:
                why += f" (found at {current}: lowered before this controller's start)"
            data = {"max_num_seqs": target}
            self.metrics.actions.labels("engine max_num_seqs").inc()
            self._record([Decision(now, name, "engine max_num_seqs", why, data)])

    async def _move_streams(self, detectors: Mapping[str, Detector], now: float) -> None:
        """Once per episode, after the routes moved: the contended endpoint's running
        standard and sheddable streams continue elsewhere (by continuation, byte-exact),
        instead of stalling on the slow device until they end."""
        for name, det in detectors.items():
            if det.condition != "contended":
                self._moved.discard(name)
                continue
            if not self.s.move_streams or name in self._moved:
                continue
            self._moved.add(name)
            prios = ["standard", "sheddable"]
            moving: list[Any] = []
            for url in self.sensing.gateway_views:
                try:
                    r = await self.sensing.admin(url).rebalance(
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
        for url in self.sensing.gateway_views:
            # What the gateway reports, so that a restarted one gets the override again;
            # what was applied only where its routes could not be read this window.
            has = self.sensing.gateway_routes.get(url, self._routes_applied.get(url))
            if has is not None and _routes(has) == _routes(want):
                self._routes_applied[url] = want
                continue
            try:
                if want:
                    await self.sensing.admin(url).set_routes_override(routes=want)
                else:
                    await self.sensing.admin(url).clear_routes_override()
                self._routes_applied[url] = want
            except AdminError as e:
                self.metrics.errors.labels("apply").inc()
                log.warning("could not update the routes of the gateway %s: %s", url, e)
        if want == self.routes_wanted or (not want and self.routes_wanted is None):
            self.routes_wanted = want
            return
        self.routes_wanted = want
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


def _routes(r: Mapping[str, list[str]]) -> dict[str, list[str]]:
    """A routes override as the gateway keeps it (priorities with no pool dropped)."""
    return {k: list(v) for k, v in r.items() if v}
