"""Endpoints from Kubernetes: each `--k8s-service POOL=NAMESPACE/SERVICE` is watched through
its EndpointSlices and mapped onto the gateway's own endpoint lifecycle:

    slice says                      gateway does
    ready (not terminating)      →  add; traffic only after our two-stage warm-up
    not ready / terminating      →  drain (no new requests, streams continue, migrate at the
                                    drain deadline); an endpoint already draining (the pod's
                                    preStop got there first) is left alone
    gone from every slice        →  drain with deadline 0: what still streams migrates now
                                    (one last seen ready: only if still gone after a short
                                    grace, as it may be moving to another slice)

Only endpoints this module added are touched. With `--k8s-peers NAMESPACE/SERVICE` (the
gateway's own Service) each replica takes its share of every engine's cap, so the cap holds
for the engine as a whole: share_i = cap // n + (1 if i < cap % n), i = this pod's rank
among the n live replicas (at least 1, so a replica never starves; with more replicas than
cap the cap then overshoots, and the log says so).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge

from unbroken.gateway._pool import Endpoint, State
from unbroken.k8s.discovery import K8sSettings, ServiceRef, SliceEndpoint, SliceWatcher

if TYPE_CHECKING:
    from collections.abc import Callable

    from unbroken.gateway._control import GatewayControl

__all__ = ["Discovery", "K8sSettings", "cap_share"]

log = logging.getLogger("unbroken.gateway.discovery")


def cap_share(total: int, replicas: int, rank: int) -> int:
    """This replica's part of `total` when `replicas` gateways share it; the parts add up to
    `total` exactly while replicas <= total."""
    replicas = max(1, replicas)
    return max(1, total // replicas + (1 if rank < total % replicas else 0))


class Discovery:
    def __init__(self, gw: GatewayControl, settings: K8sSettings) -> None:
        self.gw = gw
        self.s = settings
        self.managed: dict[str, str] = {}  # endpoint name → pool, for endpoints we added
        self.released: set[str] = set()  # managed names their slice has shown not ready
        self.last: dict[str, SliceEndpoint] = {}  # managed name → its last slice entry
        self.missing: dict[str, float] = {}  # managed name → when it left every slice
        # An endpoint moving between slices (the controller rewrites one, then adds it to
        # another: two events) is briefly in none; a ready one is removed only if still gone
        # after this long.
        self.move_grace_s = 1.5
        self._pools: dict[str, SliceWatcher] = {}
        self._rechecks: dict[str, asyncio.TimerHandle] = {}
        self.replicas = 1
        self.rank = 0
        self.reconcile_s = 2.0
        self._tasks: list[asyncio.Task[None]] = []
        self.watchers: list[SliceWatcher] = []
        r = gw.metrics.registry
        self.m_api = Gauge(
            "unbroken_gateway_k8s_api_up",
            "1 while the Kubernetes API answers the EndpointSlice list/watch of a Service; "
            "0 while the gateway serves from the last known endpoints.",
            ["service"],
            registry=r,
        )
        self.m_restarts = Counter(
            "unbroken_gateway_k8s_watch_restarts",
            "EndpointSlice watch restarts (gone: 410 re-list; dropped; ended: at once; "
            "timeout; error: list failed; watch failing: 3+ watches in a row failed at once).",
            ["service", "reason"],
            registry=r,
        )
        self.m_replicas = Gauge(
            "unbroken_gateway_k8s_gateway_replicas",
            "Live gateway replicas sharing each engine's cap.",
            registry=r,
        )
        self.m_replicas.set(1)

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        pools = []
        for pool, ref in self.s.services.items():
            w = self._watch(ref, lambda eps, pool=pool: self.apply(pool, eps))
            self._pools[pool] = w
            pools.append((pool, w))
        if self.s.peers is not None:
            self._watch(self.s.peers, self.apply_peers)
        self._tasks.append(asyncio.create_task(self._reconcile(pools), name="k8s-reconcile"))

    async def _reconcile(self, pools: list[tuple[str, SliceWatcher]]) -> None:
        """Re-apply the last known view now and then: an endpoint that turned ready again while
        its drain was still finishing is added back once the gateway has let it go, even if
        no new slice event comes."""
        while True:
            await asyncio.sleep(self.reconcile_s)
            for pool, w in pools:
                if w.synced:
                    self.apply(pool, w.endpoints)

    def _watch(
        self, ref: ServiceRef, on_change: Callable[[dict[str, SliceEndpoint]], None]
    ) -> SliceWatcher:
        label = str(ref)

        def on_api(up: bool, why: str | None) -> None:
            self.m_api.labels(label).set(1 if up else 0)
            if why:
                self.m_restarts.labels(label, why).inc()

        self.m_api.labels(label).set(0)
        w = SliceWatcher(ref, on_change, client_factory=self.s.client_factory, on_api=on_api)
        self.watchers.append(w)
        self._tasks.append(asyncio.create_task(w.run(), name=f"k8s-{label}"))
        return w

    def _recheck(self, pool: str, after: float) -> None:
        """Apply the pool's view again once a missing endpoint's grace is over."""
        if pool in self._rechecks:
            return

        def again() -> None:
            del self._rechecks[pool]
            w = self._pools.get(pool)
            if w is not None and w.synced:
                self.apply(pool, w.endpoints)

        self._rechecks[pool] = asyncio.get_running_loop().call_later(after, again)

    async def stop(self) -> None:
        for h in self._rechecks.values():
            h.cancel()
        self._rechecks.clear()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    # -- mapping ---------------------------------------------------------------------------
    def cap_for(self, pool: str) -> int | None:
        total = self.s.pool_caps.get(pool)
        if self.s.peers is None:
            return total
        if total is None:
            total = self.gw.cfg.default_cap
        return cap_share(total, self.replicas, self.rank)

    def apply(self, pool: str, endpoints: dict[str, SliceEndpoint]) -> None:
        gw = self.gw
        for name, e in endpoints.items():
            ep = gw.pool.get(name)
            mine = self.managed.get(name) == pool
            if ep is not None and not mine:
                continue  # added by hand or by another pool's Service: not ours
            if e.ready and not e.terminating:
                if ep is None:
                    if mine and name not in self.released:
                        # The gateway let it go while its slice still says ready: drained by
                        # the pod's preStop (the slice's `terminating` is on its way) or by
                        # hand. It stays out until the slice says otherwise.
                        continue
                    self.released.discard(name)
                    gw.add_endpoint(e.url, name=name, pool_name=pool, cap=self.cap_for(pool))
                    self.managed[name] = pool
                continue
            if mine:
                self.released.add(name)  # seen not ready: ready again later is a fresh start
            if ep is not None and ep.state not in (State.DRAINING, State.GONE):
                if ep.state in (State.STARTING, State.WARMING):
                    gw.remove_endpoint(ep)  # never served: nothing to drain
                else:
                    why = "terminating" if e.terminating else "not ready"
                    log.info("%s is %s in its EndpointSlice: draining", name, why)
                    gw.drain_endpoint(ep, None)
        now = time.monotonic()
        for name, p in list(self.managed.items()):
            if p != pool:
                continue
            if name in endpoints:
                self.last[name] = endpoints[name]
                self.missing.pop(name, None)
                continue
            last = self.last.get(name)
            if last is not None and last.ready and not last.terminating:
                since = self.missing.setdefault(name, now)
                if now - since < self.move_grace_s:
                    self._recheck(pool, since + self.move_grace_s - now + 0.05)
                    continue
            ep = gw.pool.get(name)
            del self.managed[name]
            self.released.discard(name)
            self.last.pop(name, None)
            self.missing.pop(name, None)
            if ep is None:
                continue
            if ep.state in (State.STARTING, State.WARMING) or ep.inflight == 0:
                gw.remove_endpoint(ep)
            else:
                log.info(
                    "%s left its EndpointSlice with %d in flight: migrating", name, ep.inflight
                )
                gw.drain_endpoint(ep, 0.0)

    def apply_peers(self, endpoints: dict[str, SliceEndpoint]) -> None:
        # A terminating replica still serving keeps its streams, so it keeps its share.
        live = {n for n, e in endpoints.items() if e.ready or e.serving}
        if self.s.pod:
            live.add(self.s.pod)  # not ready yet in its own Service, but already serving
        order = sorted(live)
        replicas = max(1, len(order))
        rank = order.index(self.s.pod) if self.s.pod in order else 0
        if (replicas, rank) == (self.replicas, self.rank):
            return
        self.replicas, self.rank = replicas, rank
        self.m_replicas.set(replicas)
        log.info("%d gateway replica(s) live, this one is #%d", replicas, rank)
        for name, pool in self.managed.items():
            ep = self.gw.pool.get(name)
            if ep is not None:
                self._set_cap(ep, pool)
        self.gw.admission.wake()

    def _set_cap(self, ep: Endpoint, pool: str) -> None:
        ep.cap = self.cap_for(pool)
        total = self.s.pool_caps.get(pool, self.gw.cfg.default_cap)
        if self.replicas > total:
            log.warning(
                "%d gateway replicas share a cap of %d on %s: each keeps 1, the cap overshoots",
                self.replicas,
                total,
                ep.name,
            )
