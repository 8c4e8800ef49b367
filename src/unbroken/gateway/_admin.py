"""The gateway's admin API (own port, bearer token): endpoints, drains, caps, routes."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

import orjson
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, field_validator

from unbroken.gateway._admission import PRIORITIES
from unbroken.gateway._pool import Endpoint, State
from unbroken.wire.errors import ApiError
from unbroken.wire.http import bearer_auth_middleware, error_middleware
from unbroken.wire.openai import parse_request

if TYPE_CHECKING:
    from unbroken.gateway._control import GatewayControl

__all__ = ["admin_app"]

M = TypeVar("M", bound=BaseModel)
Name = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:@-]+$")]


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


class AddEndpoint(_In):
    url: Annotated[str, Field(pattern=r"^https?://[^\s/]+(/[^\s]*)?$", max_length=2048)]
    name: Name | None = None
    pool: Name = "default"
    cap: Annotated[int, Field(ge=0, le=1_000_000)] | None = None
    warmup: bool = True

    @field_validator("url")
    @classmethod
    def _strip(cls, v: str) -> str:
        return v.rstrip("/")


class PatchEndpoint(_In):
    cap: Annotated[int, Field(ge=0, le=1_000_000)] | None = None
    pool: Name | None = None
    # Set by the controller: its cap (null clears it) and its verdict on the endpoint.
    cap_override: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    condition: Literal["normal", "contended", "recovering"] | None = None


class Rebalance(_In):
    priorities: Annotated[
        list[Literal["critical", "standard", "sheddable"]], Field(min_length=1, max_length=3)
    ] = ["standard", "sheddable"]
    # Paced: `batch` streams (for the whole gateway) every `every_s` seconds; null: all now.
    batch: Annotated[int, Field(ge=1, le=100_000)] | None = None
    every_s: Annotated[float, Field(gt=0, le=60)] = 0.1


class Routes(_In):
    routes: dict[Literal["critical", "standard", "sheddable"], list[Name]]


class Drain(_In):
    deadline_s: Annotated[float, Field(ge=0, le=86_400)] | None = None


def _parse(model: type[M], body: bytes) -> M:
    return parse_request(model, body or b"{}")[0]


def admin_app(gw: GatewayControl, token: str) -> web.Application:
    @web.middleware
    async def synced(request: web.Request, handler: Any) -> web.StreamResponse:
        """A change is answered once every worker serves with it (one process: at once)."""
        resp = await handler(request)
        if request.method != "GET":
            await gw.sync()
        return resp

    app = web.Application(
        middlewares=[error_middleware, bearer_auth_middleware(token), synced],
        client_max_size=1 << 20,
    )
    pool = gw.pool

    def get(request: web.Request) -> Endpoint:
        name = request.match_info["name"]
        ep = pool.get(name)
        if ep is None:
            raise ApiError(404, f"no endpoint named {name!r}", param="name", code="not_found")
        return ep

    def dump(ep: Endpoint) -> dict[str, Any]:
        return ep.as_dict(pool.default_cap)

    def json(obj: Any, status: int = 200) -> web.Response:
        return web.Response(status=status, body=orjson.dumps(obj), content_type="application/json")

    async def list_endpoints(request: web.Request) -> web.Response:
        return json({"endpoints": [dump(e) for e in pool.endpoints.values()]})

    def added(spec: AddEndpoint, param: str) -> Endpoint:
        """`spec` added (named `host:port` unless it names itself); 409 on a taken name."""
        name = spec.name or spec.url.split("://", 1)[1]
        if (old := pool.get(name)) is not None and old.state != State.GONE:
            raise ApiError(409, f"an endpoint named {name!r} exists", param=param, code="conflict")
        return gw.add_endpoint(
            spec.url, name=name, pool_name=spec.pool, cap=spec.cap, warmup=spec.warmup
        )

    async def add_endpoint(request: web.Request) -> web.Response:
        return json(dump(added(_parse(AddEndpoint, await request.read()), "name")), status=201)

    async def show(request: web.Request) -> web.Response:
        return json(dump(get(request)))

    async def patch(request: web.Request) -> web.Response:
        ep = get(request)
        body = await request.read()
        spec = _parse(PatchEndpoint, body)
        fields = orjson.loads(body or b"{}")
        gw.patch_endpoint(ep, {k: getattr(spec, k) for k in fields})
        return json(dump(ep))

    async def delete(request: web.Request) -> web.Response:
        ep = get(request)
        gw.remove_endpoint(ep)
        return json({"removed": ep.name, "inflight": ep.inflight})

    async def drain(request: web.Request) -> web.Response:
        ep = get(request)
        spec = _parse(Drain, await request.read())
        gw.drain_endpoint(ep, spec.deadline_s)
        return json(dump(ep))

    async def rebalance(request: web.Request) -> web.Response:
        """Move this endpoint's running streams of the given priorities elsewhere now, by
        continuation; `moving` is null where workers hold the streams (each moves its own)."""
        ep = get(request)
        spec = _parse(Rebalance, await request.read())
        n = gw.rebalance(ep, spec.priorities, spec.batch, spec.every_s)
        return json({"endpoint": ep.name, "priorities": spec.priorities,
                     "moving": None if n < 0 else n})  # fmt: skip

    def routes_view() -> dict[str, Any]:
        return {
            "routes": {p: pool.pools_for(p) for p in PRIORITIES},
            "configured": {p: pool.configured_pools_for(p) for p in PRIORITIES},
            "override": dict(pool.routes_override),
            "pool_order": pool.pool_order,
        }

    def parse_routes(body: bytes) -> dict[str, list[str]]:
        routes = _parse(Routes, body).routes
        known = {e.pool for e in pool.endpoints.values()} | set(pool.pool_order)
        for prio, pools in routes.items():
            unknown = [p for p in pools if p not in known]
            if unknown:
                raise ApiError(
                    400,
                    f"routes.{prio} names unknown pool(s): {', '.join(unknown)}; "
                    f"known pools: {', '.join(sorted(known)) or 'none'}",
                    param=f"routes.{prio}",
                )
        return {k: list(v) for k, v in routes.items() if v}

    async def get_routes(request: web.Request) -> web.Response:
        return json(routes_view())

    async def put_routes(request: web.Request) -> web.Response:
        gw.set_routes(parse_routes(await request.read()))
        return json(routes_view())

    async def put_routes_override(request: web.Request) -> web.Response:
        """The controller's temporary routes; DELETE restores the configured ones."""
        gw.set_routes_override(parse_routes(await request.read()))
        return json(routes_view())

    async def delete_routes_override(request: web.Request) -> web.Response:
        gw.set_routes_override({})
        return json(routes_view())

    async def status(request: web.Request) -> web.Response:
        return json(
            {
                "uptime_s": round(time.time() - gw.started, 3),
                "listen": f"http://{gw.cfg.host}:{gw.port}",
                "endpoints": [dump(e) for e in pool.endpoints.values()],
                "queue": gw.admission.queue_depth(),
                "routes": {p: pool.pools_for(p) for p in PRIORITIES},
                "routing": gw.cfg.routing,  # the policy by name (docs/gateway.md, "Routing")
                **gw.process_status(),
            }
        )

    # vllm-router's worker routes, for the scripts and autoscaler hooks a user brings from
    # it (its shapes; here behind the admin token, on the admin port): a worker is an
    # endpoint by URL.
    def live() -> list[Endpoint]:
        return [e for e in pool.endpoints.values() if e.state != State.GONE]

    def by_url(request: web.Request) -> tuple[str, Endpoint | None]:
        url = request.query.get("url", "").rstrip("/")
        if not url:
            raise ApiError(400, "missing query parameter `url`", param="url")
        return url, next((e for e in live() if e.url == url), None)

    def base_model(e: Endpoint) -> str:
        """The model an endpoint serves, not an alias or adapter: the spec's name for its
        pool when it serves it, else the first of its names that is no adapter."""
        declared = pool.pool_models.get(e.pool) or []
        if declared and declared[0] in e.models:
            return declared[0]
        bases = sorted(e.models - e.adapters.keys())
        return bases[0] if bases else "unknown"

    def text(body: str, status: int = 200) -> web.Response:
        return web.Response(status=status, text=body)

    async def workers(request: web.Request) -> web.Response:
        eps = live()
        return json(
            {
                "workers": [
                    {
                        "url": e.url,
                        "model_id": base_model(e),
                        "worker_type": "regular",
                        "is_healthy": e.healthy and e.state == State.READY,
                        "load": e.inflight,
                        "connection_mode": "Http",
                        # Ours beside theirs: the endpoint's name, pool and state.
                        "name": e.name,
                        "pool": e.pool,
                        "state": str(e.state),
                    }
                    for e in eps
                ],
                "total": len(eps),
                "stats": {"prefill_count": 0, "decode_count": 0, "regular_count": len(eps)},
            }
        )

    async def list_workers(request: web.Request) -> web.Response:
        return json({"urls": [e.url for e in live()]})

    async def get_loads(request: web.Request) -> web.Response:
        return json({"workers": [{"worker": e.url, "load": e.inflight} for e in live()]})

    async def add_worker(request: web.Request) -> web.Response:
        """`?url=` (and ours: `pool=`, else the first pool of the routes), added as POST
        /admin/endpoints adds it (warm-up, then ready)."""
        url, ep = by_url(request)
        body = {"url": url, "pool": request.query.get("pool") or _first_pool()}
        spec = _parse(AddEndpoint, orjson.dumps(body))
        if ep is not None:
            raise ApiError(400, f"Worker {spec.url} already exists", param="url", code="conflict")
        added(spec, "url")
        return text(f"Successfully added worker: {spec.url}")

    async def remove_worker(request: web.Request) -> web.Response:
        """As DELETE /admin/endpoints/{name}: removed now, its streams finish. A URL not
        registered is 404 (vllm-router answers it 200)."""
        url, ep = by_url(request)
        if ep is None:
            raise ApiError(404, f"no worker {url}", param="url", code="not_found")
        gw.remove_endpoint(ep)
        return text(f"Successfully removed worker: {url}")

    def _first_pool() -> str:
        """The first pool of the standard route (the configured routes, else every pool)."""
        order = [p for p in pool.configured_pools_for("standard") if p]
        return order[0] if order else "default"

    app.router.add_get("/workers", workers)
    app.router.add_get("/list_workers", list_workers)
    app.router.add_get("/get_loads", get_loads)
    app.router.add_post("/add_worker", add_worker)
    app.router.add_post("/remove_worker", remove_worker)
    app.router.add_get("/admin/endpoints", list_endpoints)
    app.router.add_post("/admin/endpoints", add_endpoint)
    app.router.add_get("/admin/endpoints/{name}", show)
    app.router.add_patch("/admin/endpoints/{name}", patch)
    app.router.add_delete("/admin/endpoints/{name}", delete)
    app.router.add_post("/admin/endpoints/{name}/drain", drain)
    app.router.add_post("/admin/endpoints/{name}/rebalance", rebalance)
    app.router.add_get("/admin/routes", get_routes)
    app.router.add_put("/admin/routes", put_routes)
    app.router.add_put("/admin/routes/override", put_routes_override)
    app.router.add_delete("/admin/routes/override", delete_routes_override)
    app.router.add_get("/admin/status", status)
    return app
