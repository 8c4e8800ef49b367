"""The gateway process: public OpenAI routes, the admin API on its own port, the prober.

`Gateway` is all of it in one process (`_run.serve`, `--workers 1`). With more workers the
main process (`_main_gateway.MainGateway`) owns the listening socket, the admin API, the prober and
discovery, and supervises worker processes (`_worker.WorkerGateway`) that serve the public
routes; both are Gateways. How a process is started and stopped is in `_run`/`_process`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from unbroken.config.spec import GatewaySettings
from unbroken.gateway._admin import admin_app
from unbroken.gateway._admission import Admission
from unbroken.gateway._affinity import CacheAware
from unbroken.gateway._engine_routes import LORA_ROUTES, RESPONSE_ROUTES
from unbroken.gateway._headers import request_id
from unbroken.gateway._metrics import GatewayMetrics
from unbroken.gateway._pool import Endpoint, Pool, State
from unbroken.gateway._prefix_share import PrefixShare, replica_id
from unbroken.gateway._prober import Prober
from unbroken.gateway._proxy import PASSTHROUGH_ROUTES, Proxy
from unbroken.gateway._ratelimit import Limiter, TenantTable
from unbroken.gateway._routing import make_policy
from unbroken.gateway._tenants import Tenants
from unbroken.wire.exposition import render_text
from unbroken.wire.heap import freeze_startup_heap
from unbroken.wire.http import (
    BODY_LIMIT_HINT,
    Cors,
    ServerLimits,
    body_middleware,
    client_session,
    error_middleware,
    start_site,
)

if TYPE_CHECKING:
    from collections.abc import Iterable

    from unbroken.gateway._discovery import Discovery, K8sSettings
    from unbroken.gateway._prefix_table import PrefixTable
    from unbroken.gateway._shared import SharedCounters

__all__ = ["Gateway", "GatewayConfig", "StaticEndpoint"]

log = logging.getLogger("unbroken.gateway")

GatewayConfig = GatewaySettings


@dataclass(frozen=True)
class StaticEndpoint:
    url: str
    pool: str = "default"
    name: str | None = None


class Gateway:
    def __init__(
        self,
        cfg: GatewayConfig,
        admin_token: str,
        shared: SharedCounters | None = None,
        prefix_table: PrefixTable | None = None,
        tenant_table: TenantTable | None = None,
        tenant_slots: dict[str, int] | None = None,
    ) -> None:
        self.cfg = cfg
        self.admin_token = admin_token
        self.pool = Pool(cfg.default_cap, make_policy(cfg, prefix_table))
        self.pool.routes = {k: list(v) for k, v in cfg.routes.items()}
        self.pool.configure(cfg.pool_models, cfg.sleeping_pools)
        self.admission = Admission(
            self.pool,
            queue_timeout=cfg.queue_timeout_s,
            max_queue=cfg.max_queue,
            max_queue_bytes=cfg.max_queue_bytes,
            shared=shared,
        )
        self.proxy = Proxy(cfg, self.pool, self.admission, None, self._after_release)
        self.share: PrefixShare | None = None  # `prefix_share_url`: see `start_share`
        self.metrics = GatewayMetrics(self.pool, self.admission, self.proxy.sinks)
        self.proxy.metrics = self.metrics
        self.tenant_table = tenant_table
        if cfg.tenants:
            # Tenants (issue 25): workers share the main process's table and its slots
            # (by name); a single process has its own table in anonymous memory.
            if self.tenant_table is None:
                self.tenant_table = TenantTable()
            slots = tenant_slots or {t.name: i for i, t in enumerate(cfg.tenants)}
            self.proxy.tenants = Tenants(cfg.tenants)
            self.proxy.limiter = Limiter(cfg.tenants, cfg.rate_limit, self.tenant_table, slots)
            self.metrics.init_tenants([t.name for t in cfg.tenants])
        self.prober: Prober | None = None
        self.started = time.time()
        self.port = cfg.port
        self.admin_port = cfg.admin_port
        self._runners: list[web.AppRunner] = []
        self._drain_timers: dict[str, asyncio.TimerHandle] = {}
        self.discovery: Discovery | None = None
        self.closing: str | None = None  # why /health says not ready (shutting down)
        self.inflight_requests = 0  # public requests being answered, for the drain
        self.draining = False  # the listener is closed; connections close after a request

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
        self._attach(ep)
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

    def rebalance(
        self,
        ep: Endpoint,
        priorities: Iterable[str],
        batch: int | None = None,
        every_s: float = 0.1,
    ) -> int:
        """Move the streams of these priorities off `ep` by continuation (as at a drain
        deadline): the controller's answer to a contended device, whose running streams would
        otherwise stall until they end. All at once, or `batch` streams every `every_s`
        seconds: each continuation prefills its prompt and what it generated on the next
        endpoint, so moving dozens at once puts one long prefill in front of every new
        request there. Returns how many streams are to move."""
        wanted = set(priorities)

        def todo() -> list[Any]:
            # Streams still waiting for their first token first: moving one costs only its
            # prompt's prefill, and it gains the most (it would wait out the slow steps).
            return sorted(
                (
                    r
                    for r in list(ep.relays)
                    if getattr(r, "priority", None) in wanted and r.interrupted is None
                ),
                key=lambda r: not r.first_pending(ep),
            )

        def step() -> None:
            if self.pool.get(ep.name) is not ep:
                return  # removed: what is left finishes there
            left = todo()
            for relay in left if batch is None else left[:batch]:
                relay.interrupt("rebalance")
            if batch is not None and len(left) > batch:
                asyncio.get_running_loop().call_later(every_s, step)

        total = len(todo())
        step()
        if total:
            log.info(
                "rebalancing %s: moving %d %s stream(s)%s",
                ep.name,
                total,
                "/".join(wanted),
                "" if batch is None or total <= batch else f", {batch} every {every_s:g} s",
            )
        return total

    def _after_release(self, ep: Endpoint) -> None:
        if ep.state == State.DRAINING and ep.inflight == 0 and self.pool.get(ep.name) is ep:
            self.remove_endpoint(ep)

    async def read_models(self) -> None:
        """Every ready endpoint's models, read again now (`Prober.read_models`)."""
        if self.prober is not None:
            eps = [e for e in self.pool.endpoints.values() if e.state == State.READY]
            await self.prober.read_models(eps)

    def _on_change(self, ep: Endpoint) -> None:
        self._changed()

    async def start_share(self, *, publish: bool, subscribe: bool, owner_pid: int) -> None:
        """With `prefix_share_url`: tell other gateway replicas what this process sends
        where (`publish`: it serves), and record what they send (`subscribe`: it owns the
        index). The policy must be prefix-aware; others have nothing to share."""
        url = self.cfg.prefix_share_url
        policy = _prefix_policy(self.pool.policy)
        if url is None or policy is None:
            return
        endpoints = self.pool.endpoints

        def learn(name: str, blocks: list[int]) -> None:
            ep = endpoints.get(name)
            if ep is not None and ep.state == State.READY:
                policy.learn(ep, blocks)

        self.share = PrefixShare(
            url, replica_id(owner_pid), learn if subscribe else None, self.cfg.prefix_index_blocks
        )
        await self.share.start()
        if publish:
            policy.share = self.share
        what = [
            w for w, on in (("publishing", publish), ("recording the others'", subscribe)) if on
        ]
        log.info("prefix share via %s: %s", url.split("@")[-1], " and ".join(what))

    def _on_restart(self, ep: Endpoint) -> None:
        """`ep`'s engine started again at the same address: its KV cache is empty, so the
        policy must not credit it with the prefixes sent there before."""
        self.pool.restarted(ep)

    def _attach(self, ep: Endpoint) -> None:
        """A new endpoint joins: where its in-flight count lives (see the main process)."""

    def _changed(self) -> None:
        """Endpoints, caps or routes changed: queued requests may fit now."""
        self.admission.wake()

    # -- what the admin API changes --------------------------------------------------------
    def patch_endpoint(self, ep: Endpoint, fields: dict[str, Any]) -> None:
        """Apply an admin PATCH: `cap` and `cap_override` (None clears), `condition`, `pool`."""
        if "cap" in fields:
            ep.cap = fields["cap"]
        if "cap_override" in fields:
            ep.cap_override = fields["cap_override"]
        if fields.get("condition") is not None:
            ep.set_condition(fields["condition"])
        if (pool := fields.get("pool")) is not None:
            ep.pool = pool
            if pool not in self.pool.pool_order:
                self.pool.pool_order.append(pool)
        self._changed()

    def set_routes(self, routes: dict[str, list[str]]) -> None:
        self.pool.routes = routes
        self._changed()

    def set_routes_override(self, routes: dict[str, list[str]]) -> None:
        """The controller's temporary routes; {} restores the configured ones."""
        self.pool.routes_override = routes
        self._changed()

    async def sync(self) -> None:
        """Return once a change is live where requests are served (see the main process)."""

    def process_status(self) -> dict[str, Any]:
        """The process model, for /admin/status."""
        return {"workers": {"serving": 1, "draining": 0, "pids": [os.getpid()]}}

    # -- HTTP ---------------------------------------------------------------------------------
    def public_app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.cfg.max_body_bytes,
            middlewares=[
                self._count_inflight,
                error_middleware,
                body_middleware(self.cfg.body_timeout_s),
                self.metrics.count_unknown_routes(self._auth_unrouted),
            ],
        )
        app[BODY_LIMIT_HINT] = (
            "the gateway's max_body_bytes; raise it with --max-body-bytes or the setting, "
            "as large base64 images need"
        )
        app.on_response_prepare.append(self._on_prepare)
        Cors(self.cfg.cors_allowed_origins).install(app)
        app.router.add_post("/v1/completions", self.proxy.completions)
        app.router.add_post("/v1/chat/completions", self.proxy.chat)
        app.router.add_get("/v1/models", self.proxy.models)
        app.router.add_get("/v1/models/{model:.+}", self.proxy.model)  # ids may hold a "/"
        for method, route in PASSTHROUGH_ROUTES:  # engine routes forwarded as they are
            app.router.add_route(method, route, self.proxy.passthrough)
        for method, route in RESPONSE_ROUTES:  # asked of the replica holding the response
            app.router.add_route(method, route, self.proxy.response_by_id)
        for method, route in LORA_ROUTES:  # applied on every replica of the base model
            app.router.add_route(method, route, self.proxy.lora_adapter)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ping", self.health)  # vLLM's (SageMaker's) name for /health
        app.router.add_post("/ping", self.health)
        # vllm-router's probe routes, for a load balancer or kubelet that asks them.
        app.router.add_get("/liveness", self.liveness)
        app.router.add_get("/readiness", self.readiness_probe)
        app.router.add_get("/metrics", self.metrics_handler)
        return app

    def _auth_unrouted(self, request: web.Request) -> None:
        """With tenants, a /v1 path with no route (404) or not for this method (405) checks
        the key first (401), as vLLM with `--api-key` guards every /v1 path before routing:
        a bad key learns nothing of the routes. Preflights (OPTIONS) are not asked for one."""
        if (
            self.proxy.tenancy.tenants is not None
            and request.path.startswith("/v1")
            and request.method != "OPTIONS"
        ):
            self.proxy.tenancy.resolve(request)

    @web.middleware
    async def _count_inflight(self, request: web.Request, handler: Any) -> web.StreamResponse:
        self.inflight_requests += 1
        try:
            return await handler(request)
        finally:
            self.inflight_requests -= 1

    async def health(self, request: web.Request) -> web.Response:
        if self.closing is not None:  # readiness false first, so a Service stops sending
            return web.Response(status=503, text=f"not ready: {self.closing}\n")
        return web.Response(text=self.readiness() + "\n")

    async def liveness(self, request: web.Request) -> web.Response:
        """vllm-router's `/liveness`: the process answers (its body, `OK`)."""
        return web.Response(text="OK")

    async def readiness_probe(self, request: web.Request) -> web.Response:
        """vllm-router's `/readiness`: 200 while some endpoint is ready to serve, else 503
        (`/health` stays 200 then: the gateway itself is up and queues), and 503 while it
        shuts down."""
        eps = list(self.pool.endpoints.values())
        ready = len(_serving(eps))
        body: dict[str, object] = {"healthy_workers": ready, "total_workers": len(eps)}
        if self.closing is not None:
            body |= {"status": "not ready", "reason": self.closing}
        elif not ready:
            body |= {"status": "not ready", "reason": self.readiness().removeprefix("ok, but ")}
        else:
            return web.json_response({"status": "ready", **body})
        return web.json_response(body, status=503)

    def readiness(self) -> str:
        """The gateway is up either way (200); the text says whether it can serve. While it
        shuts down /health answers 503 with the reason instead."""
        eps = list(self.pool.endpoints.values())
        if not eps:
            return (
                "ok, but no endpoints: requests get 503 until one is added "
                "(--endpoint, POST /admin/endpoints or discovery)"
            )
        ready = _serving(eps)
        if not ready:
            return "ok, but no endpoint is ready: " + "; ".join(
                f"{e.name} {_health_word(e)}" + (f" ({e.last_error})" if e.last_error else "")
                for e in eps
            )
        return f"ok: {len(ready)} of {len(eps)} endpoint(s) ready"

    async def metrics_handler(self, request: web.Request) -> web.Response:
        return web.Response(
            body=render_text(self.metrics.registry),
            headers={"Content-Type": CONTENT_TYPE_LATEST},
        )

    def start_control_plane(
        self, static: list[StaticEndpoint], *, warmup: bool, k8s: K8sSettings | None
    ) -> None:
        """The upstream session, the prober, the static endpoints and discovery: what the
        single process and the workers' main process both run."""
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
            on_restart=self._on_restart,
        )
        self.proxy.on_hang = self.prober.suspect
        self.proxy.read_models = self.read_models
        for s in static:
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
            if self.proxy.limiter is not None:  # tenants' local shares split like the caps
                d = self.discovery
                self.proxy.limiter.peers = lambda: (d.replicas, d.rank)

    async def start(
        self,
        static: list[StaticEndpoint] | None = None,
        *,
        warmup: bool = True,
        k8s: K8sSettings | None = None,
    ) -> None:
        cfg = self.cfg
        self.start_control_plane(static or [], warmup=warmup, k8s=k8s)
        limits = ServerLimits(cfg.header_timeout_s, cfg.max_connections_per_client)
        freeze_startup_heap()
        public = await start_site(self.public_app(), cfg.host, cfg.port, limits=limits)
        admin = await start_site(
            admin_app(self, self.admin_token),
            cfg.admin_host,
            cfg.admin_port,
            limits=ServerLimits(cfg.header_timeout_s),
        )
        self._runners = [public, admin]
        await self.start_share(publish=True, subscribe=True, owner_pid=os.getpid())
        self.port = _bound_port(public) or cfg.port
        self.admin_port = _bound_port(admin) or cfg.admin_port
        log.info(
            "gateway on http://%s:%d, admin on http://%s:%d",
            cfg.host,
            self.port,
            cfg.admin_host,
            self.admin_port,
        )

    async def drain_public(
        self, runner: web.AppRunner, timeout: float, force: asyncio.Event, why: str
    ) -> int:
        """Stop accepting on `runner`'s listener, let open requests and streams finish up to
        `timeout` (or until `force` is set), then end what is left with an SSE error event.
        Returns how many streams had to be ended.

        Keep-alive connections are not cut between requests (a client that reuses one would
        see it close under its next request): each answers its next request with
        `Connection: close` and closes after it. Connections idle for IDLE_GRACE_S with
        nothing in flight are closed then."""
        self.draining = True
        for site in list(runner.sites):
            await site.stop()  # this process's listener only; a shared socket lives on
        server = runner.server
        deadline = time.monotonic() + timeout
        quiet_since: float | None = None
        while not force.is_set():
            now = time.monotonic()
            conns = len(getattr(server, "_connections", ())) if server is not None else 0
            if self.inflight_requests == 0 and conns == 0:
                break
            if self.inflight_requests > 0:
                quiet_since = None
            elif quiet_since is None:
                quiet_since = now
            elif now - quiet_since >= IDLE_GRACE_S:
                break  # only idle keep-alive connections are left
            if now >= deadline:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(force.wait(), min(deadline - now, 0.05))
        ended = 0
        if self.inflight_requests > 0:
            for sink in list(self.proxy.sinks):
                ended += 1
                sink.evict(
                    f"the gateway is shutting down ({why}) and this stream did not finish "
                    "in time; it was ended",
                    code="shutdown",
                )
            log.warning(
                "%d request(s) still open after the drain, %d stream(s) ended with an error event",
                self.inflight_requests,
                ended,
            )
            t_end = time.monotonic() + 1.0  # let the error events reach their clients
            while self.inflight_requests > 0 and time.monotonic() < t_end:
                await asyncio.sleep(0.02)
        if server is not None:
            server.pre_shutdown()  # idle connections close now, busy ones after their request
        return ended

    async def _on_prepare(self, request: web.Request, resp: web.StreamResponse) -> None:
        # Every answer echoes the request's id (docs/gateway.md), the routes that do not set
        # it themselves (/v1/models, /ping, adapters, 404s) included.
        if "X-Request-ID" not in resp.headers:
            resp.headers["X-Request-ID"] = request_id(request)
        if self.draining:
            resp.force_close()
            resp.headers["Connection"] = "close"

    async def stop(self) -> None:
        if self.share is not None:
            await self.share.close()
        if self.discovery is not None:
            await self.discovery.stop()
        for r in self._runners:
            await r.cleanup()
        if self.prober is not None:
            await self.prober.close()
        if self.proxy.session is not None:
            await self.proxy.session.close()
        self.proxy.upstream.close()
        if self.proxy.limiter is not None:
            await self.proxy.limiter.close()


def _prefix_policy(policy: Any) -> CacheAware | None:
    """The prefix-aware policy inside `policy` (adapter affinity wraps it), or None."""
    while policy is not None and not isinstance(policy, CacheAware):
        policy = getattr(policy, "inner", None)
    return policy


def _bound_port(runner: web.AppRunner) -> int | None:
    for site in runner.sites:
        server = getattr(site, "_server", None)
        if server is not None and server.sockets:
            return int(server.sockets[0].getsockname()[1])
    return None


# A draining process closes keep-alive connections that stayed idle this long.
IDLE_GRACE_S = 1.0


def _health_word(e: Endpoint) -> str:
    """An endpoint's state as /health reports it: a ready one out of rotation is not "ready"
    (a review read "no endpoint is ready: a ready (...)")."""
    if e.state != State.READY:
        return str(e.state)
    return "down" if e.down else "out of rotation"


def _serving(eps: list[Endpoint]) -> list[Endpoint]:
    """The endpoints in rotation (what /health and /readiness count as ready)."""
    return [e for e in eps if e.state == State.READY and e.healthy]
