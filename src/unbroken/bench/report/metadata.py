"""What a report is about besides its records: the named time windows (`Span`) and moments
(`Marker`) drawn on every plot, the run's metadata (version, date, command, machine: what a
reader needs to trust it), and the millisecond format every table uses."""

from __future__ import annotations

import datetime as dt
import os
import platform
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Marker", "Span", "as_marker", "as_span", "fmt_ms", "run_metadata"]


@dataclass(frozen=True)
class Span:
    """A named time window, shaded on every plot."""

    name: str
    start: float
    end: float


@dataclass(frozen=True)
class Marker:
    """A moment worth a vertical line and a label (an event, a controller decision)."""

    t: float
    label: str


def fmt_ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f} ms"


def run_metadata(
    *,
    command: str | None = None,
    started: float | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, str]:
    """Version, date, command and machine: what a reader of a report needs to trust it."""
    from unbroken import __version__

    when = dt.datetime.fromtimestamp(started, dt.UTC) if started else dt.datetime.now(dt.UTC)
    meta = {
        "unbroken": __version__,
        "date": when.strftime("%Y-%m-%d %H:%M:%S UTC"),
        "command": command if command is not None else " ".join(sys.argv),
        "machine": f"{platform.node()}: {os.cpu_count()} CPUs, {_memory()}, "
        f"{platform.system()} {platform.release()}, Python {platform.python_version()}",
    }
    meta.update({k: str(v) for k, v in (extra or {}).items()})
    return meta


def _memory() -> str:
    try:
        with open("/proc/meminfo") as f:
            kib = int(f.readline().split()[1])
        return f"{kib / 2**20:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        return "RAM unknown"


def as_span(s: Span | Mapping[str, Any]) -> Span:
    return s if isinstance(s, Span) else Span(str(s["name"]), float(s["start"]), float(s["end"]))


def as_marker(m: Marker | Mapping[str, Any]) -> Marker:
    if isinstance(m, Marker):
        return m
    return Marker(float(m["t"]), str(m.get("label") or m.get("event") or ""))
