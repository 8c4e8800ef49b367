"""What every unbroken exporter serves besides its own metrics: `unbroken_build_info`, the
`process_*` series and `python_info`, so dashboards can tell versions apart, see restarts
(`process_start_time_seconds`) and memory, the same on the gateway, engine simulator, agent
and controller."""

from __future__ import annotations

import platform

from prometheus_client import (
    CollectorRegistry,
    Info,
    PlatformCollector,
    ProcessCollector,
)

__all__ = ["register_standard_metrics"]


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
