"""What a gateway process does around its `Gateway`, the same in the single process
(`_run.serve`) and in the main process of workers (`_main.serve_main`): the admin token, the
signals that stop it, the warning about endpoints that do not answer, and how many workers
to run by default. Kept apart from both so that neither imports the other."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from unbroken.wire import http

if TYPE_CHECKING:
    from unbroken.gateway._server import Gateway

__all__ = [
    "MAX_DEFAULT_WORKERS",
    "READINESS_LEAD_S",
    "UNREADY_WARNING_S",
    "default_workers",
    "resolve_token",
    "second_forces",
    "warn_unready",
]

log = logging.getLogger("unbroken.gateway")

# Between readiness going false and the listener closing (wire.http, where the supervisor
# reads it too: its stop budget waits for this gateway's drain).
READINESS_LEAD_S = http.READINESS_LEAD_S
UNREADY_WARNING_S = 5.0
MAX_DEFAULT_WORKERS = 8


def second_forces(stop: asyncio.Event, force: asyncio.Event) -> None:
    """The first SIGTERM drains; a second one ends what is left at once."""
    if stop.is_set():
        log.warning("second signal: ending the streams still open")
        force.set()
    stop.set()


def resolve_token(admin_token: str | None) -> str:
    if admin_token:
        return admin_token
    from unbroken.config.paths import admin_token as stored_token
    from unbroken.config.paths import state_dir

    token, path, _ = stored_token(state_dir())  # say where the token is, never what it is
    log.warning("no admin token given: the admin API takes the one in %s", path)
    return token


def default_workers() -> int:
    """One per core this process may run on (its CPU affinity, and a cgroup v2 CPU quota such
    as a Kubernetes CPU limit), at most MAX_DEFAULT_WORKERS: past that the main process and
    the shared lock, not the cores, bound the gain."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    with contextlib.suppress(OSError, ValueError):
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            n = min(n, -(-int(quota) // int(period)))  # a limit of 1.5 CPUs: 2 workers
    return max(1, min(n, MAX_DEFAULT_WORKERS))


def warn_unready(gw: Gateway) -> None:
    """No endpoint, or none that answers (wrong URL, not started), is worth a line in the
    log; called a moment after start, so a supervisor registering its engines is no alarm."""
    text = gw.readiness()
    if text.startswith("ok, but"):
        log.warning("%s", text.removeprefix("ok, but "))
