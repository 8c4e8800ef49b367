"""The gateway process: public OpenAI routes, the admin API on its own port, the prober."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from unbroken.config.spec import GatewaySettings
from unbroken.gateway._admin import admin_app
from unbroken.gateway._admission import Admission
from unbroken.gateway._metrics import GatewayMetrics
from unbroken.gateway._pool import Endpoint, Pool, State
from unbroken.gateway._prober import Prober
from unbroken.gateway._proxy import Proxy
from unbroken.wire.http import (
    ServerLimits,
    body_middleware,
    client_session,
    error_middleware,
    start_site,
)

if TYPE_CHECKING:
    from unbroken.gateway._discovery import Discovery, K8sSettings

__all__ = ["Gateway", "GatewayConfig", "StaticEndpoint", "run_gateway"]

log = logging.getLogger("unbroken.gateway")

GatewayConfig = GatewaySettings


@dataclass(frozen=True)
class StaticEndpoint:
    url: str
    pool: str = "default"
    name: str | None = None


class Gateway:
    def __init__(self, cfg: GatewayConfig, admin_token: str) -> None:
        self.cfg = cfg
        self.admin_token = admin_token
        self.pool = Pool(cfg.default_cap)
        self.pool.routes = {k: list(v) for k, v in cfg.routes.items()}
        self.admission = Admission(
            self.pool,
            queue_timeout=cfg.queue_timeout_s,
            max_queue=cfg.max_queue,
            max_queue_bytes=cfg.max_queue_bytes,
        )
        self.proxy = Proxy(cfg, self.pool, self.admission, None, self._after_release)
        self.metrics = GatewayMetrics(self.pool, self.admission, self.proxy.sinks)
        self.proxy.metrics = self.metrics
        self.prober: Prober | None = None
        self.started = time.time()
        self.port = cfg.port
        self.admin_port = cfg.admin_port
        self._runners: list[web.AppRunner] = []
        self._drain_timers: dict[str, asyncio.TimerHandle] = {}
        self.discovery: Discovery | None = None

    # -- endpoint lifecycle (called by the admin API and at start) ------------------------
    def add_endpoint(
        self,
        url: str,
        *,
        name: str,
        pool_name: str = "default",
        cap: int | None = None,
        warmup: bool = True,
    ) -> Endpoint:
        ep = Endpoint(name=name, url=url.rstrip("/"), pool=pool_name, cap=cap, warmup=warmup)
        self.pool.add(ep)
        assert self.prober is not None
        self.prober.watch(ep)
        log.info("endpoint %s added (%s, pool %s)", name, url, pool_name)
        return ep

    def remove_endpoint(self, ep: Endpoint) -> None:
        if self.pool.get(ep.name) is ep:
            self.pool.remove(ep.name)
        if self.prober is not None:
            self.prober.forget(ep.name)
        if (h := self._drain_timers.pop(ep.name, None)) is not None:
            h.cancel()
        log.info("endpoint %s removed (%d stream(s) still finishing)", ep.name, ep.inflight)

    def drain_endpoint(self, ep: Endpoint, deadline_s: float | None) -> None:
        """No new requests; in-flight ones finish; removed once empty. The deadline is
        recorded (mid-stream migration at the deadline builds on it)."""
        deadline = self.cfg.drain_deadline_s if deadline_s is None else deadline_s
        ep.set_state(State.DRAINING)
        ep.drain_deadline = time.monotonic() + deadline
        log.info("draining %s: %d in flight, deadline %.1f s", ep.name, ep.inflight, deadline)
        if (h := self._drain_timers.pop(ep.name, None)) is not None:
            h.cancel()
        self._drain_timers[ep.name] = asyncio.get_running_loop().call_later(
            deadline, self._drain_deadline, ep
        )
        self._after_release(ep)

    def _drain_deadline(self, ep: Endpoint) -> None:
        """The deadline passed: the streams still on `ep` continue elsewhere."""
        self._drain_timers.pop(ep.name, None)
        if ep.relays:
            log.info("drain deadline of %s: migrating %d stream(s)", ep.name, len(ep.relays))
        for relay in list(ep.relays):
            relay.interrupt("drain_deadline")

    def _after_release(self, ep: Endpoint) -> None:
        if ep.state == State.DRAINING and ep.inflight == 0 and self.pool.get(ep.name) is ep:
            self.remove_endpoint(ep)

    def _on_change(self, ep: Endpoint) -> None:
        self.admission.wake()

    # -- HTTP ---------------------------------------------------------------------------------
    def public_app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.cfg.max_body_bytes,
            middlewares=[
                error_middleware,
                body_middleware(self.cfg.body_timeout_s),
                self.metrics.count_unknown_routes(),
            ],
        )
        app.router.add_post("/v1/completions", self.proxy.completions)
        app.router.add_post("/v1/chat/completions", self.proxy.chat)
        app.router.add_get("/v1/models", self.proxy.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_handler)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text=self.readiness() + "\n")

    def readiness(self) -> str:
        """The gateway is up either way (200); the text says whether it can serve."""
        eps = list(self.pool.endpoints.values())
        if not eps:
            return (
                "ok, but no endpoints: requests get 503 until one is added "
                "(--endpoint, POST /admin/endpoints or discovery)"
            )
        ready = [e for e in eps if e.state == State.READY and e.healthy]
        if not ready:
            return "ok, but no endpoint is ready: " + "; ".join(
                f"{e.name} {e.state}" + (f" ({e.last_error})" if e.last_error else "") for e in eps
            )
        return f"ok: {len(ready)} of {len(eps)} endpoint(s) ready"

    async def metrics_handler(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.metrics.registry),
            headers={"Content-Type": CONTENT_TYPE_LATEST},
        )

    async def start(
        self,
        static: list[StaticEndpoint] | None = None,
        *,
        warmup: bool = True,
        k8s: K8sSettings | None = None,
    ) -> None:
        cfg = self.cfg
        session = client_session(connect_timeout=cfg.connect_timeout_s)
        self.proxy.session = session
        self.prober = Prober(
            session,
            interval=cfg.probe_interval_s,
            fail_threshold=cfg.health_fail_threshold,
            warmup_timeout=cfg.warmup_timeout_s,
            on_change=self._on_change,
            headers_for=lambda ep: self.proxy.upstream_headers({}, ep),
        )
        self.proxy.on_hang = self.prober.suspect
        for s in static or []:
            self.add_endpoint(
                s.url,
                name=s.name or s.url.split("://", 1)[-1].rstrip("/"),
                pool_name=s.pool,
                warmup=warmup,
            )
        if k8s is not None:  # lightkube is imported only when discovery is on
            from unbroken.gateway._discovery import Discovery

            self.discovery = Discovery(self, k8s)
            self.discovery.start()
        limits = ServerLimits(cfg.header_timeout_s, cfg.max_connections_per_client)
        public = await start_site(self.public_app(), cfg.host, cfg.port, limits=limits)
        admin = await start_site(
            admin_app(self, self.admin_token),
            cfg.admin_host,
            cfg.admin_port,
            limits=ServerLimits(cfg.header_timeout_s),
        )
        self._runners = [public, admin]
        self.port = _bound_port(public) or cfg.port
        self.admin_port = _bound_port(admin) or cfg.admin_port
        log.info(
            "gateway on http://%s:%d, admin on http://%s:%d",
            cfg.host,
            self.port,
            cfg.admin_host,
            self.admin_port,
        )

    async def stop(self) -> None:
        if self.discovery is not None:
            await self.discovery.stop()
        for r in self._runners:
            await r.cleanup()
        if self.prober is not None:
            await self.prober.close()
        if self.proxy.session is not None:
            await self.proxy.session.close()


def _bound_port(runner: web.AppRunner) -> int | None:
    for site in runner.sites:
        server = getattr(site, "_server", None)
        if server is not None and server.sockets:
            return int(server.sockets[0].getsockname()[1])
    return None


async def serve(
    cfg: GatewayConfig,
    admin_token: str | None,
    static: list[StaticEndpoint],
    warmup: bool = True,
    k8s: K8sSettings | None = None,
) -> None:
    token = admin_token
    if not token:  # say where the token is, never what it is
        from unbroken.config.paths import admin_token as stored_token
        from unbroken.config.paths import state_dir

        token, path, _ = stored_token(state_dir())
        log.warning("no admin token given: the admin API takes the one in %s", path)
    gw = Gateway(cfg, token)
    try:
        await gw.start(static, warmup=warmup, k8s=k8s)
    except OSError:
        await gw.stop()  # e.g. a port in use: close what was opened, then report it
        raise
    # No endpoint, or none that answers (wrong URL, not started), is worth a line in the log;
    # after a moment, so that a supervisor registering its engines causes no false alarm.
    asyncio.get_running_loop().call_later(UNREADY_WARNING_S, _warn_unready, gw)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("gateway stopping")
    await gw.stop()


UNREADY_WARNING_S = 5.0


def _warn_unready(gw: Gateway) -> None:
    text = gw.readiness()
    if text.startswith("ok, but"):
        log.warning("%s", text.removeprefix("ok, but "))


def run_gateway(
    cfg: GatewayConfig,
    admin_token: str | None,
    static: list[StaticEndpoint],
    warmup: bool = True,
    k8s: K8sSettings | None = None,
) -> None:
    import uvloop

    uvloop.run(serve(cfg, admin_token, static, warmup, k8s))
