"""What the controller wants the gateway to do, given the endpoints' conditions (pure logic).

- contended: lower the endpoint's in-flight cap (the gateway-side stand-in for
  `max_num_seqs`, which vLLM cannot change at run time) to a fraction of what it was running;
  while any full-precision endpoint is contended, route standard and sheddable work to the
  degraded (fp8) tier first and keep critical work on full precision. Sheddable work then gets
  429 with Retry-After from the gateway's admission when the degraded tier has no room.
- recovering: capacity first, then traffic. The cap doubles every `recover_step_s` until it
  reaches the configured cap, when the override is cleared and the endpoint is normal again;
  only then do the routes come back. (Routes restored while the cap was still lowered sent the
  recovering replica's share of standard work to its full-precision siblings: in the demo the
  other fp16 replica went from 100 to 132 streams and its TTFT p99.9 from 111 to 165 ms,
  while the fp8 tier that had carried that work stood idle.) During the steps the replica's
  critical traffic, which never left it, is the probe the classifier watches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from unbroken.config.spec import ControllerSettings
from unbroken.controller.classify import Transition

__all__ = ["Actuator", "Decision", "EndpointView", "Tiers"]


@dataclass(frozen=True)
class Tiers:
    full: tuple[str, ...]
    degraded: tuple[str, ...]

    def override(self) -> dict[str, list[str]]:
        return {
            "critical": list(self.full),
            "standard": [*self.degraded, *self.full],
            "sheddable": list(self.degraded),
        }


@dataclass
class EndpointView:
    """An endpoint as the gateway's admin API lists it."""

    name: str
    pool: str
    url: str
    state: str
    inflight: int
    configured_cap: int
    cap_override: int | None
    condition: str
    slow_clients: int = 0
    models: tuple[str, ...] = ()

    @classmethod
    def from_admin(cls, d: dict[str, Any]) -> EndpointView:
        return cls(
            name=d["name"],
            pool=d.get("pool", "default"),
            url=d["url"],
            state=d.get("state", ""),
            inflight=int(d.get("inflight", 0)),
            configured_cap=int(d.get("configured_cap", d.get("cap", 0))),
            cap_override=d.get("cap_override"),
            condition=d.get("condition", "normal"),
            slow_clients=int(d.get("slow_clients", 0)),
            models=tuple(d.get("models") or ()),
        )


@dataclass
class Decision:
    t: float  # unix time
    endpoint: str
    action: str
    reason: str
    data: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "t": self.t,
            "endpoint": self.endpoint,
            "action": self.action,
            "reason": self.reason,
            **self.data,
        }


class Actuator:
    """Desired cap overrides and routes; the service applies what differs from the gateway."""

    def __init__(self, settings: ControllerSettings, tiers: Tiers) -> None:
        self.s = settings
        self.tiers = tiers
        self.caps: dict[str, int | None] = {}
        self._next_step: dict[str, float] = {}

    def on_transition(
        self, tr: Transition, view: EndpointView | None, running: float, now: float
    ) -> list[Decision]:
        out: list[Decision] = []
        name = tr.endpoint
        out.append(Decision(now, name, f"condition {tr.old} -> {tr.new}", tr.reason))
        if tr.new == "contended":
            base = view.configured_cap if view else self.s.min_cap
            busy = max(view.inflight if view else 0, running)
            cap = min(base, max(self.s.min_cap, math.ceil(busy * self.s.cap_factor)))
            self.caps[name] = cap
            self._next_step.pop(name, None)
            out.append(
                Decision(
                    now,
                    name,
                    "lower cap",
                    f"contended: cap {base} -> {cap} ({self.s.cap_factor:g} x {busy:.0f} busy)",
                    {"cap": cap},
                )
            )
        elif tr.new == "recovering":
            self._next_step[name] = tr.t + self.s.recover_step_s
        elif tr.new == "normal":
            self.caps.pop(name, None)
            self._next_step.pop(name, None)
        return out

    def resume(self, name: str, cap: int | None, condition: str, mono: float) -> None:
        """Take over a cap override found on the gateway (set by an earlier controller
        process): kept as it is, and raised step by step from there once recovering."""
        if cap is None:
            self.caps.pop(name, None)
        else:
            self.caps[name] = cap
        if condition == "recovering":
            self._next_step[name] = mono + self.s.recover_step_s
        else:
            self._next_step.pop(name, None)

    def step_up(
        self, name: str, view: EndpointView | None, mono: float, now: float
    ) -> tuple[list[Decision], bool]:
        """Raise a recovering endpoint's cap one step when due. Returns the decisions and
        whether every setting is back (the override cleared)."""
        due = self._next_step.get(name)
        cap = self.caps.get(name)
        if cap is None:
            return [], True
        if due is None or mono < due:
            return [], False
        configured = view.configured_cap if view else cap
        new = cap * 2
        if new >= configured:
            self.caps[name] = None
            self._next_step.pop(name, None)
            return [
                Decision(
                    now,
                    name,
                    "restore cap",
                    f"recovering: cap {cap} -> configured {configured}",
                    {"cap": configured},
                )
            ], True
        self.caps[name] = new
        self._next_step[name] = mono + self.s.recover_step_s
        return [
            Decision(now, name, "raise cap", f"recovering: cap {cap} -> {new}", {"cap": new})
        ], False

    def routes(self, conditions: dict[str, str], pools: dict[str, str]) -> dict[str, list[str]]:
        """The routes override wanted now ({} = the configured routes)."""
        if not self.tiers.full or not self.tiers.degraded:
            return {}
        degraded_full = any(
            pools.get(n) in self.tiers.full
            and (c == "contended" or (c == "recovering" and self.caps.get(n) is not None))
            for n, c in conditions.items()
        )
        return self.tiers.override() if degraded_full else {}
