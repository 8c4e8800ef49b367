"""Dynamic precision (the seed's "alter precision dynamically"), off by default.

When a full-precision endpoint has been contended for `convert_after_s`, the controller asks
the pipeline to convert that replica to the degraded (fp8) tier through the zero-downtime
path (surge a degraded replica, two-stage readiness, drain the old one with a deadline,
migrate the rest). It never goes below `min_full_replicas` full-precision replicas, so
critical traffic always has somewhere to go, and it converts one replica at a time. When no
full-precision endpoint has been contended for `convert_back_after_s`, it converts the
replicas it moved back, one at a time.

The pipeline does the work: under `unbroken up` through the supervisor's control socket
(`POST /convert`). Planning is pure (`plan`); `Converter` only talks to the socket.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from unbroken.clients import SupervisorClient, SupervisorError, SupervisorRejected
from unbroken.config.spec import ControllerSettings

__all__ = ["ConvertPlan", "Converter", "plan"]

log = logging.getLogger("unbroken.controller")


@dataclass
class ConvertPlan:
    endpoint: str
    to_pool: str
    reason: str
    back: bool = False


@dataclass
class PrecisionState:
    # endpoint now in the degraded tier → the full pool it came from
    converted: dict[str, str] = field(default_factory=dict)
    last_contended: float | None = None  # monotonic: last window a full endpoint was contended
    last_conversion: float | None = None  # monotonic: when the last conversion finished


def plan(
    s: ControllerSettings,
    st: PrecisionState,
    now: float,
    *,
    full: tuple[str, ...],
    degraded: tuple[str, ...],
    conditions: dict[str, tuple[str, float]],  # endpoint → (condition, since)
    pools: dict[str, str],  # endpoint → pool (ready endpoints)
) -> ConvertPlan | None:
    """The one conversion to start now, if any."""
    if s.convert_after_s is None or not full or not degraded:
        return None
    full_eps = [n for n, p in pools.items() if p in full]
    contended = [
        (since, n)
        for n, (c, since) in conditions.items()
        if c == "contended" and pools.get(n) in full
    ]
    # No flapping: after any conversion the pipeline keeps its shape for the quiet period.
    settled = st.last_conversion is None or now - st.last_conversion >= s.convert_back_after_s
    if contended:
        st.last_contended = now
        since, name = min(contended)
        if (
            settled
            and now - since >= s.convert_after_s
            and len(full_eps) - 1 >= s.min_full_replicas
        ):
            return ConvertPlan(
                name,
                degraded[0],
                f"contended for {now - since:.1f} s (>= {s.convert_after_s:g} s); "
                f"{len(full_eps) - 1} full-precision replica(s) stay (floor "
                f"{s.min_full_replicas})",
            )
        return None
    if st.converted and (
        st.last_contended is None or now - st.last_contended >= s.convert_back_after_s
    ):
        name = next(iter(st.converted))
        if name in pools:
            quiet = "never" if st.last_contended is None else f"{now - st.last_contended:.1f} s"
            return ConvertPlan(
                name,
                st.converted[name],
                f"no full-precision contention for {quiet} (>= {s.convert_back_after_s:g} s)",
                back=True,
            )
    return None


class Converter:
    """Asks a local supervisor (`unbroken up`) to convert a replica: a summary (`ok`,
    `new`, `seconds`), or `ok: False` and the reason, never an exception."""

    def __init__(self, socket_path: str, timeout: float = 300.0) -> None:
        self.client = SupervisorClient(socket_path)
        self.timeout = timeout

    async def convert(self, endpoint: str, to_pool: str) -> dict[str, Any]:
        try:
            return await self.client.convert(endpoint, to_pool, read_timeout=self.timeout)
        except SupervisorRejected as e:
            return {"ok": False, "error": f"HTTP {e.status}: {e.message}"}
        except SupervisorError as e:
            return {"ok": False, "error": str(e)}
