"""Slow storage on a fast disk: the kernel's block-I/O read limit, through a cgroup.

The seed's standard deployment reads its weights from network storage (140 GB in 480 s,
about 300 MB/s). The demo stands in for it by putting its own process tree in a cgroup whose
reads from the weights' block device are capped: cgroup v1 `blkio.throttle.read_bps_device`
or cgroup v2 `io.max rbps`. Both are enforced by the block layer on real I/O only, so a page
already in the page cache costs nothing: exactly the difference pre-warming makes.

Needs root and a writable blkio (v1) or io (v2) controller; `IoThrottle.create` raises
`ThrottleUnavailable` with the reason otherwise. Partitions are mapped to their disk (the
kernel accepts whole disks only); a file on an overlay or tmpfs has no block device to limit.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from unbroken.pipeline.cpucap import remove_cgroup, sweep_dead_owners

__all__ = ["IoThrottle", "ThrottleUnavailable", "block_device", "drop_page_cache"]

V1_ROOT = Path("/sys/fs/cgroup/blkio")
V2_ROOT = Path("/sys/fs/cgroup")
PREFIX = "unbroken-io-"  # + the demo's pid
SEED_BPS = 300_000_000  # the seed's network storage: 140 GB in 480 s ≈ 292 MB/s


class ThrottleUnavailable(RuntimeError):
    """Block-I/O throttling cannot be set up here; the message says why."""


def block_device(path: Path) -> str:
    """`MAJ:MIN` of the whole disk holding `path` (a partition is mapped to its disk)."""
    st = os.stat(path)
    majmin = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    sys_dev = Path("/sys/dev/block") / majmin
    if not sys_dev.exists():
        raise ThrottleUnavailable(
            f"{path} is on device {majmin}, which is not a block device "
            "(overlay, tmpfs or network filesystem): nothing to throttle"
        )
    if (sys_dev / "partition").exists():
        disk = sys_dev.resolve().parent
        majmin = (disk / "dev").read_text().strip()
    return majmin


def drop_page_cache(files: list[Path]) -> None:
    """Evict the files from the page cache (POSIX_FADV_DONTNEED on each: only these files,
    unlike `echo 1 > /proc/sys/vm/drop_caches`, which would slow every other process too)."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _v2_root() -> Path | None:
    """The cgroup v2 mount where the io controller is available, if any."""
    for root in (V2_ROOT, V2_ROOT / "unified"):
        ctrl = root / "cgroup.controllers"
        with contextlib.suppress(OSError):
            if "io" in ctrl.read_text().split():
                return root
    return None


@dataclass
class IoThrottle:
    """A cgroup with a read-bandwidth cap on one block device. `add(pid)` puts a process in
    it (what it starts afterwards inherits it); the demo adds only its weight readers."""

    path: Path
    version: int
    device: str
    read_bps: int

    @classmethod
    def create(cls, storage: Path, read_bps: int = SEED_BPS, name: str | None = None) -> IoThrottle:
        if os.geteuid() != 0:
            raise ThrottleUnavailable("not root: cgroup block-I/O limits need root")
        device = block_device(storage)
        name = name or f"{PREFIX}{os.getpid()}"
        if (V1_ROOT / "blkio.throttle.read_bps_device").exists():
            cg, version, knob = V1_ROOT / name, 1, "blkio.throttle.read_bps_device"
            value = f"{device} {read_bps}"
            # A demo killed before its cleanup left its cgroup (two here after killed suites).
            sweep_dead_owners(V1_ROOT, PREFIX)
        elif (root := _v2_root()) is not None:
            sweep_dead_owners(root, PREFIX)
            with contextlib.suppress(OSError):  # may already be on, or not ours to turn on
                (root / "cgroup.subtree_control").write_text("+io")
            cg, version, knob = root / name, 2, "io.max"
            value = f"{device} rbps={read_bps}"
        else:
            raise ThrottleUnavailable(
                "no blkio (cgroup v1) or io (cgroup v2) controller is mounted here"
            )
        try:
            cg.mkdir(exist_ok=True)
            (cg / knob).write_text(value)
        except OSError as e:
            with contextlib.suppress(OSError):
                cg.rmdir()
            raise ThrottleUnavailable(f"cannot set {cg / knob} to {value!r}: {e}") from None
        return cls(path=cg, version=version, device=device, read_bps=read_bps)

    def describe(self) -> str:
        knob = "blkio.throttle.read_bps_device" if self.version == 1 else "io.max rbps"
        return (
            f"reads from {self.device} capped at {self.read_bps / 1e6:.0f} MB/s "
            f"(cgroup v{self.version} {knob})"
        )

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def read_bytes(self) -> int:
        """Bytes read from the device by the cgroup's processes so far."""
        if self.version == 1:
            for line in (self.path / "blkio.throttle.io_service_bytes").read_text().splitlines():
                parts = line.split()
                if len(parts) == 3 and parts[0] == self.device and parts[1] == "Read":
                    return int(parts[2])
            return 0
        for line in (self.path / "io.stat").read_text().splitlines():
            parts = line.split()
            if parts and parts[0] == self.device:
                kv = dict(p.split("=", 1) for p in parts[1:] if "=" in p)
                return int(kv.get("rbytes", 0))
        return 0

    def remove(self, timeout: float = 5.0) -> None:
        """Delete the cgroup once its processes have left (children that outlive the demo are
        moved to the parent first)."""
        remove_cgroup(self.path, timeout)
