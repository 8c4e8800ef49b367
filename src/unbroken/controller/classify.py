"""Per-endpoint baselines and the condition state machine (pure logic, no I/O).

An endpoint is `contended` when its device-side signal rises well above its own learned
baseline while socket backpressure stays low (the seed's rule: slow clients raise
backpressure, not launch latency). Enter and exit thresholds differ, a crossing must hold for
a dwell time, and every condition is held for a minimum time: nothing flaps.

    normal ──(ratio ≥ enter for enter_dwell, or ≥ strong once; backpressure low)──▶ contended
    contended ──(ratio ≤ exit for exit_dwell, after min_dwell)──▶ recovering
    recovering ──(ratio ≥ enter for enter_dwell)──▶ contended
    recovering ──(the actuator has restored every setting)──▶ normal

Baselines learn only in `normal`, so an episode never teaches the controller that contention
is normal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from unbroken.config.spec import ControllerSettings

__all__ = [
    "CONDITIONS",
    "Condition",
    "CudaBaseline",
    "Detector",
    "ItlBaseline",
    "Reading",
    "Transition",
]

Condition = Literal["normal", "contended", "recovering"]
CONDITIONS: tuple[Condition, ...] = ("normal", "contended", "recovering")


class CudaBaseline:
    """Launch/copy latency when healthy: an EWMA in log space (latencies are log-normal-ish and
    a rare preempted call must not drag the mean), ready after `windows` windows."""

    def __init__(self, windows: int, alpha: float = 0.05) -> None:
        self.windows = windows
        self.alpha = alpha
        self.n = 0
        self._log = 0.0

    @property
    def ready(self) -> bool:
        return self.n >= self.windows

    @property
    def value(self) -> float | None:
        return math.exp(self._log) if self.n else None

    def state(self) -> dict[str, float]:
        return {"n": self.n, "log": self._log}

    def load(self, d: dict[str, float]) -> None:
        self.n, self._log = int(d["n"]), float(d["log"])

    def learn(self, x: float) -> None:
        if x <= 0:
            return
        lx = math.log(x)
        self.n += 1
        # Plain mean while warming up, then an EWMA that follows slow drift.
        a = max(self.alpha, 1.0 / self.n)
        self._log += a * (lx - self._log)


class ItlBaseline:
    """Inter-token latency as a function of the batch size, `itl ≈ a + b·running`, fitted by
    exponentially weighted least squares: a step of a continuous-batching engine costs a base
    plus a per-sequence part, so a busier replica is slower without being contended."""

    def __init__(self, windows: int, decay: float = 0.98) -> None:
        self.windows = windows
        self.decay = decay
        self.n = 0
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    @property
    def ready(self) -> bool:
        return self.n >= self.windows

    def state(self) -> dict[str, float]:
        return {"n": self.n, "w": self._w, "x": self._x, "y": self._y, "xx": self._xx,
                "xy": self._xy}  # fmt: skip

    def load(self, d: dict[str, float]) -> None:
        self.n = int(d["n"])
        self._w, self._x, self._y = float(d["w"]), float(d["x"]), float(d["y"])
        self._xx, self._xy = float(d["xx"]), float(d["xy"])

    def learn(self, running: float, itl: float) -> None:
        if itl <= 0:
            return
        d = self.decay
        self.n += 1
        self._w = d * self._w + 1
        self._x = d * self._x + running
        self._y = d * self._y + itl
        self._xx = d * self._xx + running * running
        self._xy = d * self._xy + running * itl

    def predict(self, running: float) -> float | None:
        if self._w <= 0:
            return None
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        # Too little spread in batch sizes to fit a slope: fall back to the mean, and never
        # extrapolate a negative slope (noise) into a smaller prediction.
        b = 0.0 if var < 1.0 else max(0.0, (self._xy / self._w - mx * my) / var)
        return max(1e-6, my + b * (running - mx))


@dataclass
class Reading:
    """What one window showed for one endpoint. `ratio` is signal / baseline from the source
    used (cuda or itl), None when neither had data or a baseline yet."""

    t: float
    source: str | None = None
    ratio: float | None = None
    value: float | None = None  # the signal (seconds)
    baseline: float | None = None  # seconds
    backpressure: float = 0.0  # socket-seconds per second
    running: float = 0.0


@dataclass
class Transition:
    endpoint: str
    old: Condition
    new: Condition
    t: float
    reason: str
    # Seconds from the first window past the enter threshold to this transition.
    detection_s: float | None = None


@dataclass
class Detector:
    """The condition of one endpoint."""

    endpoint: str
    settings: ControllerSettings
    condition: Condition = "normal"
    since: float = 0.0
    cuda: CudaBaseline = field(init=False)
    itl: ItlBaseline = field(init=False)
    _above_since: float | None = None
    _below_since: float | None = None
    last: Reading | None = None

    def __post_init__(self) -> None:
        self.cuda = CudaBaseline(self.settings.baseline_windows)
        self.itl = ItlBaseline(self.settings.baseline_windows)

    def thresholds(self, source: str) -> tuple[float, float]:
        s = self.settings
        if source == "cuda":
            return s.cuda_enter_ratio, s.cuda_exit_ratio
        return s.itl_enter_ratio, s.itl_exit_ratio

    def read(
        self,
        t: float,
        *,
        cuda_latency: float | None,
        itl: float | None,
        running: float,
        backpressure: float,
        learn: bool = True,
    ) -> Reading:
        """Turn one window's raw numbers into a ratio against this endpoint's baseline, and
        learn from it while normal (and `learn`: the caller's word that the gateway lists
        the endpoint normal, with no cap override). The CUDA signal wins when present: it
        is the direct one."""
        r = Reading(t=t, backpressure=backpressure, running=running)
        normal = learn and self.condition == "normal" and self._above_since is None
        if cuda_latency is not None:
            base = self.cuda.value if self.cuda.ready else None
            r.source, r.value, r.baseline = "cuda", cuda_latency, base
            ratio = None
            if base is not None:
                ratio = cuda_latency / base
                # Sub-threshold jitter of microsecond calls is not contention.
                if (cuda_latency - base) * 1e3 < self.settings.min_excess_ms:
                    ratio = min(ratio, 1.0)
                r.ratio = ratio
            # Learn only from windows that look healthy, so an onset never leaks into it.
            if normal and (ratio is None or ratio < self.settings.cuda_exit_ratio):
                self.cuda.learn(cuda_latency)
        if itl is not None:
            pred = self.itl.predict(running) if self.itl.ready else None
            ratio = itl / pred if pred is not None else None
            if (
                ratio is not None
                and pred is not None
                and ((itl - pred) * 1e3 < self.settings.min_itl_excess_ms)
            ):
                ratio = min(ratio, 1.0)
            if r.source is None:
                r.source, r.value, r.baseline, r.ratio = "itl", itl, pred, ratio
            if normal and (ratio is None or ratio < self.settings.itl_exit_ratio):
                self.itl.learn(running, itl)
        self.last = r
        return r

    @property
    def has_baseline(self) -> bool:
        return self.cuda.ready or self.itl.ready

    def baselines(self) -> dict[str, dict[str, float]]:
        """What was learned, to outlive the process (controller/persist.py)."""
        return {"cuda": self.cuda.state(), "itl": self.itl.state()}

    def load_baselines(self, d: dict[str, dict[str, float]]) -> bool:
        """Take over what an earlier process learned; False when it is unusable."""
        try:
            self.cuda.load(d["cuda"])
            self.itl.load(d["itl"])
        except (KeyError, TypeError, ValueError):
            self.cuda = CudaBaseline(self.settings.baseline_windows)
            self.itl = ItlBaseline(self.settings.baseline_windows)
            return False
        return True

    def resume(self, condition: Condition, t: float) -> None:
        """Start in the condition the gateway lists (a controller restarted mid-episode, or
        one that lost an endpoint and sees it again): the episode goes on from there."""
        self.condition, self.since = condition, t
        self._above_since = self._below_since = None

    @property
    def suspect(self) -> bool:
        """A window crossed the enter threshold and the dwell has not confirmed or cleared it
        yet: the moment the gateway may route around the endpoint (it looks slow), leaving
        no traffic to confirm it with."""
        return self._above_since is not None

    def step(self, r: Reading) -> Transition | None:
        """Advance the state machine by one reading."""
        s = self.settings
        if r.ratio is None or r.source is None:
            return None
        enter, exit_ = self.thresholds(r.source)
        t = r.t
        device_slow = r.ratio >= enter
        blamed_on_network = r.backpressure > s.backpressure_max
        if device_slow and not blamed_on_network:
            if self._above_since is None:
                self._above_since = t
            self._below_since = None
        elif r.ratio <= exit_:
            self._above_since = None
            if self._below_since is None:
                self._below_since = t
        else:  # between the thresholds (or slow with backpressure): hold
            self._above_since = None
            self._below_since = None
        held = t - self.since >= s.min_dwell_s or self.condition == "normal"
        numbers = (
            f"{r.source} {_fmt(r.value)} vs baseline {_fmt(r.baseline)} "
            f"(x{r.ratio:.2f}), backpressure {r.backpressure:.2f} s/s, running {r.running:.0f}"
        )
        strong = self._strong(r) and not blamed_on_network
        if (
            self.condition in ("normal", "recovering")
            and self._above_since is not None
            and (strong or self._held_for(t - self._above_since, s.enter_dwell_s))
            and held
        ):
            detection = t - self._above_since
            why = f"above x{enter:g} for {detection:.2f} s"
            if strong and detection == 0:
                why = f"above x{s.cuda_strong_ratio:g} (no dwell)"
            return self._go("contended", t, f"{numbers}: {why}", detection)
        if (
            self.condition == "contended"
            and self._below_since is not None
            and self._held_for(t - self._below_since, s.exit_dwell_s)
            and held
        ):
            return self._go(
                "recovering", t, f"{numbers}: below x{exit_:g} for {t - self._below_since:.2f} s"
            )
        return None

    def _strong(self, r: Reading) -> bool:
        """A CUDA window so far above its baseline that no dwell is needed to trust it."""
        x = self.settings.cuda_strong_ratio
        return x is not None and r.source == "cuda" and r.ratio is not None and r.ratio >= x

    def _held_for(self, elapsed: float, dwell: float) -> bool:
        """Has a crossing seen `elapsed` seconds apart held for `dwell`? Readings come every
        `interval_s`, a little early or late: with the default dwell of one interval, a next
        reading 0.199 s after the first had to wait for a third (half of the demo's
        detections took 0.4 s instead of 0.2). A quarter interval of slack counts readings,
        not milliseconds."""
        return elapsed >= dwell - 0.25 * self.settings.interval_s

    def recovered(self, t: float) -> Transition | None:
        """Called by the actuator once every setting is back: recovering → normal, unless the
        signal is rising again."""
        if self.condition != "recovering" or self._above_since is not None:
            return None
        return self._go("normal", t, "every setting restored; signal stayed below the exit")

    def _go(
        self, new: Condition, t: float, reason: str, detection: float | None = None
    ) -> Transition:
        tr = Transition(self.endpoint, self.condition, new, t, reason, detection)
        self.condition, self.since = new, t
        self._above_since = self._below_since = None
        return tr


def _fmt(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.3f} ms" if seconds < 1 else f"{seconds:.2f} s"
