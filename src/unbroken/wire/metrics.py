"""What every unbroken exporter serves besides its own metrics: `unbroken_build_info`, the
`process_*` series and `python_info`, so dashboards can tell versions apart, see restarts
(`process_start_time_seconds`) and memory, the same on the gateway, engine simulator, agent
and controller."""

from __future__ import annotations

import logging
import platform
from collections.abc import Awaitable, Callable, Iterable
from urllib.parse import urlencode

from prometheus_client import (
    CollectorRegistry,
    Info,
    PlatformCollector,
    ProcessCollector,
)

__all__ = ["FILTER_PROBE", "FilteredReads", "filtered_path", "register_standard_metrics"]

log = logging.getLogger("unbroken.metrics")

# Every vLLM (and the simulator) always has a sample of this gauge: a page asked for it by
# name that lacks it was filtered wrongly, not empty.
FILTER_PROBE = "vllm:num_requests_running"


def filtered_path(names: Iterable[str]) -> str:
    """`/metrics` asking for `names` only (`name[]`, prometheus_client's exposition filter;
    `FILTER_PROBE` always among them). A server that ignores the query sends its whole page,
    which parses the same. One that honours it but lost the series (prometheus_client's
    multiprocess collector is never selected by name: its page comes back empty) is seen by
    the page lacking `FILTER_PROBE`; the reader then asks for the whole page from there on."""
    wanted = [FILTER_PROBE, *(n for n in names if n != FILTER_PROBE)]
    return "/metrics?" + urlencode([("name[]", n) for n in wanted])


class FilteredReads:
    """Reads of engines' /metrics at `path` (a `filtered_path`), each engine's whole
    page from the first filtered page that lacks `FILTER_PROBE` on (the one rule of the
    controller, the gateway's prober and the bench's engine watch)."""

    def __init__(self, path: str) -> None:
        self.path = path  # a `filtered_path`
        self._whole: set[str] = set()  # engines (by URL) whose filter lost the series

    async def read(self, url: str, get: Callable[[str], Awaitable[str | None]]) -> str | None:
        """The page of the engine at `url`; `get(path)` fetches one (None: no page)."""
        if url in self._whole:
            return await get("/metrics")
        text = await get(self.path)
        if text is not None and FILTER_PROBE not in text:
            log.info("%s: /metrics filtered by name lost its series; reading it whole", url)
            self._whole.add(url)
            text = await get("/metrics")
        return text


def register_standard_metrics(registry: CollectorRegistry, component: str, **labels: str) -> None:
    """Add `unbroken_build_info{version, component, python, ...labels} 1`, `process_*`
    (Linux: from /proc/self) and `python_info` to `registry`; call once per registry."""
    from unbroken import __version__

    info = Info(
        "unbroken_build",
        "Version of the unbroken component serving these metrics (value always 1).",
        registry=registry,
    )
    info.info(
        {
            "version": __version__,
            "component": component,
            "python": platform.python_version(),
            **labels,
        }
    )
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
