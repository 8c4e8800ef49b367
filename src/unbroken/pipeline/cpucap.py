"""A CPU quota on a starting replica, lifted once it serves.

A replica started beside serving ones (a rollout's surge, a crash's replacement) spends its
first second or two importing and reading its weights. On the 2-core VM that read (1 GiB from
the page cache in 0.6-0.7 s) stalled every serving engine on the host 60-150 ms, and a lower
nice value, even its session's autogroup at 19, did not stop it (docs/rollout.md, "Limits"):
what the reader takes is not only its scheduler share. A quota bounds it whatever it is made
of: the kernel's CFS bandwidth control lets the cgroup's threads run at most `quota` in every
`period` (cgroup v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`, v2 `cpu.max`), system time
included. The period is short (10 ms), so a throttled reader waits milliseconds at a time, not
a long stretch.

A quota alone still let a starting replica delay serving threads: in a traced demo rollout
(perf sched, 2026-12-05) the replica's weight load ran 30-80 ms of every 100 ms while the
serving engines' and the gateway's threads waited 40-60 ms on the run queue after waking,
with CPU idle in the same tenth of a second. The cgroup is its own group entity beside every
session's autogroup, so its threads' nice value changes nothing, and its share equals one
serving engine's. `idle` marks the cgroup SCHED_IDLE (`cpu.idle`, cgroup v1 and v2, Linux
5.15+): weight 3 and preempted at once by any other thread that wakes, so it runs on what is
left. `unidle` ends that (`startup_idle_s`): on a saturated node an idle group would hardly
start at all.

Each starting replica gets its own cgroup, a child of the supervisor's; what the replica
forks while starting (vLLM's engine core) inherits it. `release` moves every process back to
where the replica was and removes the cgroup. Needs root and a mounted cpu controller;
`CpuCap.create` raises `CpuCapUnavailable` with the reason otherwise.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "PERIOD_US",
    "PREFIX",
    "CpuCap",
    "CpuCapUnavailable",
    "remove_cgroup",
    "sweep_dead_owners",
    "sweep_stale",
]

V1_ROOT = Path("/sys/fs/cgroup/cpu")
V2_ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 10_000
PREFIX = "unbroken-start-"  # + the supervisor's pid + "-" + the replica's name


class CpuCapUnavailable(RuntimeError):
    """A CPU quota cannot be set up here; the message says why."""


def _own_cgroup(version: int) -> str:
    """This process's cgroup path (relative to the hierarchy's root) for the cpu controller
    (v1) or the unified hierarchy (v2)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hid, ctrls, path = line.split(":", 2)
        if version == 2 and hid == "0":
            return path
        if version == 1 and "cpu" in ctrls.split(","):
            return path
    raise CpuCapUnavailable(f"this process has no cgroup v{version} cpu entry in /proc/self/cgroup")


@dataclass
class CpuCap:
    path: Path
    version: int
    cores: float

    @classmethod
    def create(cls, name: str, cores: float) -> CpuCap:
        if cores <= 0:
            raise ValueError(f"cores must be positive, got {cores}")
        if os.geteuid() != 0:
            raise CpuCapUnavailable("not root: cgroup CPU quotas need root")
        quota = max(1000, int(cores * PERIOD_US))
        if (V1_ROOT / "cpu.cfs_quota_us").exists():
            version = 1
            parent = V1_ROOT / _own_cgroup(1).lstrip("/")
            knobs = [("cpu.cfs_period_us", str(PERIOD_US)), ("cpu.cfs_quota_us", str(quota))]
        elif "cpu" in _read(V2_ROOT / "cgroup.controllers").split():
            version = 2
            parent = V2_ROOT / _own_cgroup(2).lstrip("/")
            with contextlib.suppress(OSError):  # may be on already, or not ours to turn on
                (parent / "cgroup.subtree_control").write_text("+cpu")
            knobs = [("cpu.max", f"{quota} {PERIOD_US}")]
        else:
            raise CpuCapUnavailable("no cpu controller (cgroup v1 or v2) is mounted here")
        cg = parent / name
        try:
            cg.mkdir(exist_ok=True)
            for knob, value in knobs:
                (cg / knob).write_text(value)
        except OSError as e:
            with contextlib.suppress(OSError):
                cg.rmdir()
            raise CpuCapUnavailable(f"cannot set up {cg}: {e}") from None
        return cls(path=cg, version=version, cores=quota / PERIOD_US)

    def describe(self) -> str:
        knob = "cpu.cfs_quota_us" if self.version == 1 else "cpu.max"
        return f"{self.cores:g} cores (cgroup v{self.version} {knob}, {PERIOD_US} us period)"

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def idle(self, on: bool = True) -> bool:
        """SCHED_IDLE for the cgroup's threads (or back to a normal share). False where the
        kernel has no `cpu.idle` (before 5.15) or refuses it."""
        try:
            (self.path / "cpu.idle").write_text("1" if on else "0")
        except OSError:
            return False
        return True

    def throttled_s(self) -> float:
        """Seconds the cgroup's threads were held back by the quota so far."""
        for line in _read(self.path / "cpu.stat").splitlines():
            k, _, v = line.partition(" ")
            if k == "throttled_time":  # v1: ns
                return int(v) / 1e9
            if k == "throttled_usec":  # v2
                return int(v) / 1e6
        return 0.0

    def release(self, timeout: float = 5.0) -> None:
        """Every process back to the parent cgroup (no quota), then the cgroup removed."""
        remove_cgroup(self.path, timeout)


def remove_cgroup(path: Path, timeout: float = 5.0) -> None:
    """Move every process of the cgroup at `path` to its parent, then remove it (v1 or v2;
    also `bench.throttle`'s). Retried while processes fork into it meanwhile."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            for pid in _read(path / "cgroup.procs").split():
                with contextlib.suppress(OSError):  # exited meanwhile
                    (path.parent / "cgroup.procs").write_text(pid)
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:  # a process forked while we moved the others: again
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def sweep_stale() -> list[str]:
    """Remove the startup cgroups of supervisors that are gone (`unbroken-start-PID-*` whose
    PID is no longer alive), moving what still runs in them back to their parent: a replica
    that was starting when its supervisor was killed keeps serving (the data plane outlives
    its supervisor) and must not stay held to the starting quota. Another live supervisor's
    cgroups are left alone. Returns the names removed; quiet where there is no cgroup."""
    removed: list[str] = []
    for version, root in ((1, V1_ROOT), (2, V2_ROOT)):
        if version == 1 and not (root / "cpu.cfs_quota_us").exists():
            continue
        if version == 2 and "cpu" not in _read(root / "cgroup.controllers").split():
            continue
        try:
            parent = root / _own_cgroup(version).lstrip("/")
        except CpuCapUnavailable:
            return removed
        return sweep_dead_owners(parent, PREFIX)
    return removed


def sweep_dead_owners(parent: Path, prefix: str) -> list[str]:
    """Remove `parent`'s child cgroups named `prefix` + PID (+ `-anything`) whose PID is not
    alive, moving what still runs in them to `parent`. Returns the names removed; quiet
    where `parent` cannot be read. Also `bench.throttle`'s for its `unbroken-io-PID`."""
    removed: list[str] = []
    try:
        children = [c for c in parent.iterdir() if c.name.startswith(prefix)]
    except OSError:
        return removed
    for cg in children:
        owner = cg.name[len(prefix) :].split("-", 1)[0]
        if not owner.isdigit() or Path(f"/proc/{owner}").exists():
            continue
        try:
            remove_cgroup(cg, timeout=2.0)
        except OSError:
            continue
        removed.append(cg.name)
    return removed


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
