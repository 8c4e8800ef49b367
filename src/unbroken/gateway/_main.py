"""The gateway's main process when it runs worker processes (`--workers N`, N > 1).

It owns the listening socket (one socket, inherited by every worker: the kernel's one accept
queue is shared, so a worker that stops accepting leaves what is queued to the others and no
connection is refused), the admin API, the prober and discovery, and the shared admission
table. It sends workers the endpoint state whenever it changes and every STATE_S, merges
their metrics into one /metrics, and:

- SIGHUP (reload): starts N new workers (the code and settings on disk now) on the same
  socket, waits until they serve, then tells the old ones to drain: they stop accepting and
  hand their open streams, with the client connections, to the new workers' handover
  sockets (round-robin; `_handover`, `handover_on_reload`), which continue them by
  continuation. A stream that cannot be handed over finishes where it is: an old worker lives
  until its last such stream ends, at most `request_timeout_s` (no stream outlives that
  anyway); how many are still draining is `unbroken_gateway_workers{state="draining"}`. If a
  new worker fails to start, the old ones keep serving and the log says why.
- SIGTERM: /health answers 503 first, the workers close their listeners READINESS_LEAD_S
  later and finish their streams up to `--shutdown-timeout`; what is left then (or at a
  second SIGTERM) ends with an SSE error event; exit 0.
- A worker that dies is replaced at once; its shared row is zeroed, so the slots its streams
  held come back, and only its own streams are lost.
- This process dying (kill -9): its workers serve on and offer the listening socket at a
  known path (`_takeover.takeover_dir`); the next main process on that port (the supervisor's
  restart) takes it there instead of binding, so no connection is refused, and the orphans
  then finish their streams and exit (`_worker.WorkerGateway.lost_main`).

The main process in three layers, one module each: this one (its life: the listening socket,
bound or taken over, start-up, signals, stop), `_main_gateway.MainGateway` (the state the
workers serve from, reloads, shutdown) and `_main_workers.WorkerProcesses` (the worker
processes: started, heard, replaced, asked for metrics).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import signal
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from unbroken.config.spec import GatewaySettings
from unbroken.gateway._main_gateway import MainGateway
from unbroken.gateway._prefix_table import PrefixTable, table_entries
from unbroken.gateway._process import (
    READINESS_LEAD_S,
    UNREADY_WARNING_S,
    resolve_token,
    second_forces,
    warn_unready,
)
from unbroken.gateway._server import StaticEndpoint
from unbroken.gateway._shared import SharedCounters
from unbroken.gateway._takeover import take_listener
from unbroken.gateway._tenant_table import TenantTable

if TYPE_CHECKING:
    from unbroken.gateway._discovery import K8sSettings

__all__ = ["MainGateway", "serve_main"]

log = logging.getLogger("unbroken.gateway.main")


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=4096)
    sock.set_inheritable(True)
    return sock


def _take_or_listen(host: str, port: int) -> tuple[socket.socket, list[socket.socket]]:
    """The listening socket that orphaned workers of a killed main process still serve on
    (the very same accept queue, so a restart refuses nothing), or a new one; and the
    connections to those workers, to close once this process's workers serve."""
    sock, orphans = take_listener(port) if port else (None, [])
    if sock is None:
        for c in orphans:
            c.close()
        return _listen(host, port), []
    log.warning(
        "took the listening socket on port %d from %d worker(s) of a main process that died; "
        "they drain once this gateway's workers serve",
        port,
        len(orphans),
    )
    sock.set_inheritable(True)
    return sock, orphans


async def serve_main(
    cfg: GatewaySettings,
    admin_token: str | None,
    static: list[StaticEndpoint],
    warmup: bool,
    k8s: K8sSettings | None,
    *,
    workers: int,
    shutdown_timeout: float,
    reload_cfg: Callable[[], GatewaySettings] | None,
) -> None:
    token = resolve_token(admin_token)
    tmp = Path(tempfile.mkdtemp(prefix="unbroken-gateway-"))
    shared = SharedCounters(tmp / "admission", create=True)
    # Sized at start from the index bound; a reload keeps it (and its contents).
    prefix = PrefixTable(table_entries(cfg.prefix_index_blocks), path=tmp / "prefix", create=True)
    # The tenants' counts, shared by the workers (always made: a reload may add tenants).
    tenants = TenantTable(tmp / "tenants", create=True)
    listen, orphans = _take_or_listen(cfg.host, cfg.port)
    gw = MainGateway(cfg, token, shared, listen, tmp, workers, prefix, tenants)
    gw.took_over = bool(orphans)
    gw.shutdown_timeout = shutdown_timeout
    loop = asyncio.get_running_loop()
    # A SIGHUP during start-up (workers may already answer /health) is kept for after it,
    # not the default action, which would end the process.
    early: list[None] = []
    loop.add_signal_handler(signal.SIGHUP, early.append, None)
    try:
        try:
            await gw.start_main(static, warmup=warmup, k8s=k8s)
        except (OSError, RuntimeError):
            await gw.shutdown(0.0, asyncio.Event())
            await gw.stop()
            raise
        finally:
            for c in orphans:  # the old workers drain now (or, if this start failed, too)
                c.close()
        loop.call_later(UNREADY_WARNING_S, warn_unready, gw)
        tick = asyncio.create_task(gw._tick())
        stop, force = asyncio.Event(), asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, second_forces, stop, force)
        loop.add_signal_handler(signal.SIGHUP, gw.reload, reload_cfg)
        if early:
            gw.reload(reload_cfg)
        await stop.wait()
        log.info("gateway stopping: draining for up to %.0f s", shutdown_timeout)
        gw.closing = "shutting down"
        gw.broadcast()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(force.wait(), READINESS_LEAD_S)
        await gw.shutdown(shutdown_timeout, force)
        tick.cancel()
        await gw.stop()
    finally:
        with contextlib.suppress(OSError):
            listen.close()
        shared.close()
        prefix.close()
        if gw.proxy.limiter is None:  # else it lives as long as the limiter's views
            tenants.close()
        shutil.rmtree(tmp, ignore_errors=True)
