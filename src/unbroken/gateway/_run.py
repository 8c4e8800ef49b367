"""The top of the gateway's stack: `run_gateway` serves until SIGTERM, in this one process
(`serve`, a `Gateway` with its public and admin ports) or as the main process of worker
processes (`_main.serve_main`). Nothing in the gateway imports this module."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import TYPE_CHECKING

from unbroken.gateway._main import serve_main
from unbroken.gateway._main_workers import WorkerGauge
from unbroken.gateway._process import (
    READINESS_LEAD_S,
    UNREADY_WARNING_S,
    default_workers,
    resolve_token,
    second_forces,
    warn_unready,
)
from unbroken.gateway._server import Gateway, GatewayConfig, StaticEndpoint

if TYPE_CHECKING:
    from collections.abc import Callable

    from unbroken.k8s.discovery import K8sSettings

__all__ = ["default_workers", "run_gateway", "serve"]

log = logging.getLogger("unbroken.gateway")


async def serve(
    cfg: GatewayConfig,
    admin_token: str | None,
    static: list[StaticEndpoint],
    warmup: bool = True,
    k8s: K8sSettings | None = None,
    shutdown_timeout: float = 30.0,
) -> None:
    """One process serves everything (`--workers 1`) until SIGTERM, then drains."""
    token = resolve_token(admin_token)
    gw = Gateway(cfg, token)
    gw.metrics.registry.register(WorkerGauge(None))
    try:
        await gw.start(static, warmup=warmup, k8s=k8s)
    except OSError:
        await gw.stop()  # e.g. a port in use: close what was opened, then report it
        raise
    asyncio.get_running_loop().call_later(UNREADY_WARNING_S, warn_unready, gw)
    stop, force = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, second_forces, stop, force)
    loop.add_signal_handler(
        signal.SIGHUP,
        lambda: log.warning("SIGHUP: a reload needs --workers 2 or more; nothing done"),
    )
    await stop.wait()
    log.info("gateway stopping: draining for up to %.0f s", shutdown_timeout)
    gw.closing = "shutting down"
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(force.wait(), READINESS_LEAD_S)
    await gw.drain_public(gw._runners[0], shutdown_timeout, force, "shutting down")
    await gw.stop()


def run_gateway(
    cfg: GatewayConfig,
    admin_token: str | None,
    static: list[StaticEndpoint],
    warmup: bool = True,
    k8s: K8sSettings | None = None,
    *,
    workers: int = 1,
    shutdown_timeout: float = 30.0,
    reload_cfg: Callable[[], GatewayConfig] | None = None,
) -> None:
    """Serve until SIGTERM. `workers` > 1: a main process and that many serving workers
    (SIGHUP reloads them); `reload_cfg` reads the settings on disk again for a reload."""
    import uvloop

    if workers <= 1:
        uvloop.run(serve(cfg, admin_token, static, warmup, k8s, shutdown_timeout))
        return
    uvloop.run(
        serve_main(
            cfg,
            admin_token,
            static,
            warmup,
            k8s,
            workers=workers,
            shutdown_timeout=shutdown_timeout,
            reload_cfg=reload_cfg,
        )
    )
