"""Injected faults: the admin API's request models and `Faults`, the one object that holds
the active ones.

`Faults` is written on the event loop (apply, clear) and read by the engine core's thread once
per step (`cuda_penalty`, `hang_remaining`) and by request handlers (`draw_failure`). Every
fault is a pure function of time from the moment it was applied (onset, ramp, expiry are
deadlines, not timers), so readers need no lock: replacing a fault is one assignment.

A new fault type is a request model here plus, where it acts, one read in the core or the
server.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["Config", "Fault", "FaultRequest", "Faults", "SlowCuda"]

_DAY = 86_400


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class SlowCuda(_Strict):
    """A contention episode on the device's bus and memory (a noisy neighbour).

    From `onset_s` after it is applied, for `duration_s` (open-ended when absent), each
    stand-in CUDA launch, graph launch and copy takes `extra_ms` longer, plus a random
    0..`jitter_ms` drawn once per step, and each step's device time (what
    `cudaStreamSynchronize` waits out) is multiplied by `factor`. With `ramp_s`, the severity
    rises linearly from zero over the first `ramp_s` seconds and falls over the last ones."""

    kind: Literal["slow_cuda"]
    extra_ms: Annotated[float, Field(ge=0, le=10_000)] = 0.0
    factor: Annotated[float, Field(ge=1, le=100)] = 1.0
    jitter_ms: Annotated[float, Field(ge=0, le=10_000)] = 0.0
    onset_s: Annotated[float, Field(ge=0, le=_DAY)] = 0.0
    ramp_s: Annotated[float, Field(ge=0, le=_DAY)] = 0.0
    duration_s: Annotated[float, Field(gt=0, le=_DAY)] | None = None

    @model_validator(mode="after")
    def _check(self) -> SlowCuda:
        if self.extra_ms == 0 and self.factor == 1 and self.jitter_ms == 0:
            raise ValueError("give a severity: extra_ms > 0, factor > 1 or jitter_ms > 0")
        if self.duration_s is not None and 2 * self.ramp_s > self.duration_s:
            raise ValueError("ramp_s must be at most half of duration_s (it ramps up and down)")
        return self

    def level(self, t: float) -> float:
        """Severity in [0, 1] at `t` seconds after the episode was applied."""
        u = t - self.onset_s
        if u < 0 or (self.duration_s is not None and u >= self.duration_s):
            return 0.0
        if self.ramp_s <= 0:
            return 1.0
        lvl = min(1.0, u / self.ramp_s)
        if self.duration_s is not None:
            lvl = min(lvl, (self.duration_s - u) / self.ramp_s)
        return max(0.0, lvl)


class Hang(_Strict):
    """The engine stops producing tokens (a stuck device) while still answering /health."""

    kind: Literal["hang"]
    duration_s: Annotated[float, Field(gt=0, le=_DAY)]


class Fail(_Strict):
    """A fraction of new requests fail: with a 500 before streaming, or with an error event
    after `after_tokens` tokens."""

    kind: Literal["fail"]
    fraction: Annotated[float, Field(ge=0, le=1)] = 1.0
    after_tokens: Annotated[int, Field(ge=1)] | None = None
    duration_s: Annotated[float, Field(gt=0, le=_DAY)] | None = None


class Crash(_Strict):
    """The process dies at once (SIGKILL to itself), as on a segfault or an OOM kill."""

    kind: Literal["crash"]


Fault = Annotated[SlowCuda | Hang | Fail | Crash, Field(discriminator="kind")]


class FaultRequest(BaseModel):
    fault: Fault


class Config(_Strict):
    """Runtime settings an admin may change (vLLM has no such endpoint; the controller lowers
    max_num_seqs with the gateway's cap where it has the engines' token)."""

    max_num_seqs: Annotated[int, Field(ge=1, le=65_536)] | None = None


@dataclass(frozen=True, slots=True)
class _Active:
    fault: SlowCuda | Hang | Fail
    applied: float  # monotonic

    def ends(self) -> float | None:
        f = self.fault
        if f.duration_s is None:
            return None
        return self.applied + (f.onset_s if isinstance(f, SlowCuda) else 0.0) + f.duration_s


class Faults:
    """The engine's active faults, at most one of each kind; a new one replaces the old."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._rng = random.Random()
        self._active: dict[str, _Active] = {}

    # -- the admin API (event loop) ------------------------------------------------------
    def apply(self, fault: SlowCuda | Hang | Fail | Crash) -> None:
        if isinstance(fault, Crash):
            # Answer first so the caller knows it was taken, then die like a real crash.
            asyncio.get_running_loop().call_later(0.05, os.kill, os.getpid(), signal.SIGKILL)
            return
        self._active = {**self._active, fault.kind: _Active(fault, self._clock())}

    def clear(self) -> None:
        self._active = {}

    def describe(self) -> dict[str, Any]:
        """The active (and pending) faults with their timings relative to now."""
        now = self._clock()
        out: dict[str, Any] = {}
        for kind, a in self._live(now).items():
            d = a.fault.model_dump(exclude={"kind"})
            if (end := a.ends()) is not None:
                d["remaining_s"] = round(end - now, 3)
            if isinstance(a.fault, SlowCuda):
                d["starts_in_s"] = round(max(0.0, a.applied + a.fault.onset_s - now), 3)
                d["level"] = round(a.fault.level(now - a.applied), 3)
            out[kind] = d
        return out

    def _live(self, now: float) -> dict[str, _Active]:
        live = {k: a for k, a in self._active.items() if (e := a.ends()) is None or e > now}
        if len(live) != len(self._active):
            self._active = live
        return live

    def _get(self, kind: str, now: float) -> _Active | None:
        a = self._active.get(kind)
        if a is None or ((e := a.ends()) is not None and e <= now):
            return None
        return a

    # -- the core thread, once per step --------------------------------------------------
    def cuda_penalty(self) -> tuple[float, float]:
        """(seconds added to each contended CUDA call this step, factor on device time)."""
        now = self._clock()
        a = self._get("slow_cuda", now)
        if a is None:
            return 0.0, 1.0
        f = a.fault
        assert isinstance(f, SlowCuda)
        lvl = f.level(now - a.applied)
        if lvl <= 0:
            return 0.0, 1.0
        extra = f.extra_ms + (self._rng.uniform(0, f.jitter_ms) if f.jitter_ms else 0.0)
        return lvl * extra / 1e3, 1.0 + lvl * (f.factor - 1.0)

    def hang_remaining(self) -> float:
        now = self._clock()
        a = self._get("hang", now)
        end = a.ends() if a else None
        return 0.0 if end is None else end - now

    # -- request handlers ----------------------------------------------------------------
    def draw_failure(self) -> int | None:
        """None: serve normally; 0: fail before answering; N: fail after N tokens."""
        a = self._get("fail", self._clock())
        if a is None:
            return None
        f = a.fault
        assert isinstance(f, Fail)
        if self._rng.random() >= f.fraction:
            return None
        return f.after_tokens or 0
