"""The controller's HTTP face and process: /metrics, /health, /state and /decisions on the
configured host and port (`build_app`), and `serve` / `run_controller`, which run one
`Controller` until SIGTERM or SIGINT."""

from __future__ import annotations

import asyncio
import logging
import math
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from unbroken.controller.config import ControllerConfig
from unbroken.wire.exposition import render_text

if TYPE_CHECKING:
    from unbroken.controller.service import Controller

__all__ = ["build_app", "run_controller", "serve"]

log = logging.getLogger("unbroken.controller")


def _json(obj: Any) -> web.Response:
    return web.Response(body=orjson.dumps(obj), content_type="application/json")


def build_app(c: Controller) -> web.Application:
    """The API of a running controller: its series, its health, its view and decisions."""
    app = web.Application()

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(
            body=render_text(c.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
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
    """Run a controller and its API until SIGTERM or SIGINT."""
    import signal

    from unbroken.controller.service import Controller  # it imports this module
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
    """`unbroken controller`: `serve` on uvloop."""
    import uvloop

    uvloop.run(serve(cfg))
