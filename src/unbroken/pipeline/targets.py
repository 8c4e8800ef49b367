"""Prometheus file-based service discovery for a local pipeline.

`unbroken up` keeps one JSON file per job in `<state>/prometheus/`: `gateway.json`,
`engines.json`, `agent.json`, `controller.json`, in the `file_sd_configs` format
(`[{"targets": ["host:port"], "labels": {...}}]`). Engine ports change with every rollout
and replacement, so the files are rewritten (atomically, by rename) whenever the set of
processes changes; Prometheus re-reads them on change. docs/prometheus.md has a ready
`prometheus.yml`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from unbroken.pipeline.supervisor import Supervisor

__all__ = ["JOBS", "keep_targets", "pipeline_targets", "write_targets"]

log = logging.getLogger("unbroken.pipeline")

JOBS = ("gateway", "engines", "agent", "controller")
Group = dict[str, Any]


def _hostport(url: str) -> str:
    u = urlsplit(url)
    host = "127.0.0.1" if u.hostname in (None, "0.0.0.0") else u.hostname
    return f"{host}:{u.port}"


def pipeline_targets(sup: Supervisor) -> dict[str, list[Group]]:
    """What Prometheus should scrape now: one group per process, labelled like the
    metrics' own `endpoint` and `pool` labels."""
    jobs: dict[str, list[Group]] = {j: [] for j in JOBS}
    jobs["gateway"].append({"targets": [_hostport(sup.gateway_url)], "labels": {}})
    for r in sorted(sup.replicas.values(), key=lambda r: r.name):
        if r.alive:
            jobs["engines"].append(
                {"targets": [_hostport(r.url)], "labels": {"endpoint": r.name, "pool": r.pool.name}}
            )
    for name, comp in sup.companions.items.items():  # agent (as root) and controller
        if name in jobs and comp.url:
            jobs[name].append({"targets": [_hostport(comp.url)], "labels": {}})
    return jobs


def write_targets(directory: Path, jobs: dict[str, list[Group]]) -> bool:
    """Write each job's file when its content changed (tmp file + rename, so Prometheus
    never reads half a file); True when anything was written."""
    directory.mkdir(parents=True, exist_ok=True)
    changed = False
    for job, groups in jobs.items():
        path = directory / f"{job}.json"
        text = json.dumps(groups, indent=1) + "\n"
        with contextlib.suppress(OSError):
            if path.read_text() == text:
                continue
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
        changed = True
    return changed


async def keep_targets(sup: Supervisor, directory: Path, interval: float = 0.5) -> None:
    """Rewrite the files whenever the pipeline's processes change, until cancelled."""
    while True:
        try:
            if write_targets(directory, pipeline_targets(sup)):
                log.debug("prometheus targets updated in %s", directory)
        except OSError as e:
            log.warning("cannot write prometheus targets in %s: %s", directory, e)
        await asyncio.sleep(interval)
