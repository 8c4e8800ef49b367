"""Dynamic precision, driven: each window, after reconciliation, ask `precision.plan` whether
a full-precision replica contended for long enough should be converted to the degraded tier
(or a converted one, quiet for long enough, converted back), and have `unbroken up`'s
supervisor do it through its control socket, one conversion at a time, in the background.
The rule itself is pure and lives in `precision.py`; this is its state and its I/O."""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

import aiohttp

from unbroken.controller.actions import Decision, EndpointView
from unbroken.controller.classify import Detector
from unbroken.controller.config import ControllerConfig
from unbroken.controller.metrics import ControllerMetrics
from unbroken.controller.precision import Converter, PrecisionState, plan

__all__ = ["PrecisionDriver"]


class PrecisionDriver:
    """Off (`converter` None) unless there is a supervisor socket and `convert_after_s`."""

    def __init__(
        self,
        cfg: ControllerConfig,
        metrics: ControllerMetrics,
        record: Callable[[list[Decision]], None],
        spawn: Callable[[Coroutine[Any, Any, None]], None],
    ) -> None:
        self.cfg = cfg
        self.s = cfg.settings
        self.metrics = metrics
        self._record = record
        self._spawn = spawn
        self.precision = PrecisionState()
        self.converting: str | None = None
        self.converter = (
            Converter(cfg.supervisor_socket)
            if cfg.supervisor_socket and self.s.convert_after_s is not None
            else None
        )

    def pools_involved(self, views: Mapping[str, EndpointView]) -> set[str]:
        """The pools a conversion is moving a replica between, or holds a converted replica
        of until it goes back: the autoscaler leaves them alone (a conversion is not load)."""
        if self.converter is None:
            return set()
        out = set(self.precision.converted.values())  # where converted replicas came from
        out.update(v.pool for n, v in views.items() if n in self.precision.converted)
        if self.converting is not None:
            out.update(self.cfg.tiers.full)
            out.update(self.cfg.tiers.degraded)
        return out

    def step(
        self,
        mono: float,
        now: float,
        detectors: Mapping[str, Detector],
        views: Mapping[str, EndpointView],
    ) -> None:
        """Note contention of the full tier; start a conversion when the plan says so."""
        if self.converter is None:
            return
        if any(
            d.condition == "contended" and views.get(n, None) is not None
            and views[n].pool in self.cfg.tiers.full
            for n, d in detectors.items()
        ):  # fmt: skip
            self.precision.last_contended = mono  # also while a conversion runs
        if self.converting is not None:
            return
        p = plan(
            self.s,
            self.precision,
            mono,
            full=self.cfg.tiers.full,
            degraded=self.cfg.tiers.degraded,
            conditions={n: (d.condition, d.since) for n, d in detectors.items()},
            pools={n: v.pool for n, v in views.items() if v.state == "ready"},
        )
        if p is None:
            return
        action = "convert back" if p.back else "convert"
        self._record([Decision(now, p.endpoint, f"{action} to {p.to_pool}", p.reason)])
        self.converting = p.endpoint
        converter = self.converter
        source = views[p.endpoint].pool if p.endpoint in views else ""

        async def go() -> None:
            try:
                res = await converter.convert(p.endpoint, p.to_pool)
            except (aiohttp.ClientError, TimeoutError, OSError) as e:
                res = {"ok": False, "error": f"supervisor unreachable: {e}"}
            finally:
                self.converting = None
            if res.get("ok"):
                # The quiet period before converting back starts now, not at the last
                # contended window before the conversion (which took seconds).
                self.precision.last_contended = time.monotonic()
                self.precision.last_conversion = time.monotonic()
                if p.back:
                    self.precision.converted.pop(p.endpoint, None)
                else:
                    self.precision.converted[res["new"]] = source
                self.metrics.actions.labels(action).inc()
                self._record(
                    [
                        Decision(
                            time.time(),
                            p.endpoint,
                            f"{action} done",
                            f"{p.endpoint} -> {res.get('new')} in {p.to_pool} after "
                            f"{res.get('seconds')} s",
                            {"result": res},
                        )
                    ]
                )
            else:
                self._record(
                    [Decision(time.time(), p.endpoint, f"{action} failed", str(res.get("error")))]
                )

        self._spawn(go())
