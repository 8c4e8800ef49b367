"""CUDA call timing: attach the uprobe pair to each CUDA library the agent finds, read the
in-kernel histograms."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from unbroken.agent import libbpf
from unbroken.agent.elf import Probe, function_offsets, plan_probe
from unbroken.agent.functions import FN_ID, FUNCTIONS
from unbroken.agent.maps import MAX_SLOTS, CallHist, CallKey

__all__ = ["CallStats", "CudaTracer", "LibraryProbes"]

log = logging.getLogger("unbroken.agent")


@dataclass
class CallStats:
    count: int = 0
    sum_ns: int = 0
    slots: list[int] = field(default_factory=lambda: [0] * MAX_SLOTS)


@dataclass
class LibraryProbes:
    path: str
    attached: list[Probe] = field(default_factory=list)
    skipped: list[Probe] = field(default_factory=list)  # would be single-stepped
    error: str | None = None


class CudaTracer:
    def __init__(self, obj_path: Path, *, allow_slow: bool = False) -> None:
        self.obj = libbpf.Object(obj_path)
        self.obj.load()
        self.allow_slow = allow_slow
        self.libraries: dict[tuple[int, int], LibraryProbes] = {}
        self._calls = self.obj.map_fd("calls")

    def attach_library(self, path: str) -> LibraryProbes | None:
        """Attach to every traced function `path` exports (once per file: uprobes follow the
        inode into every process that maps it, present and future)."""
        st = os.stat(path)
        key = (st.st_dev, st.st_ino)
        if key in self.libraries:
            return None
        rep = LibraryProbes(path)
        self.libraries[key] = rep
        try:
            found = function_offsets(Path(path), set(FUNCTIONS))
        except (OSError, ValueError) as e:
            rep.error = str(e)
            log.warning("cannot read %s: %s", path, e)
            return rep
        for name, (offset, code) in sorted(found.items()):
            probe = plan_probe(name, offset, code)
            if not probe.cheap and not self.allow_slow:
                rep.skipped.append(probe)
                log.warning(
                    "%s:%s begins with %s: a uprobe there is single-stepped (about "
                    "15 µs per call); not attached",
                    path,
                    name,
                    probe.prologue,
                )
                continue
            try:
                # The return probe first: one attached after the entry probe let a call that
                # entered in between open a per-thread record no return would close, and the
                # thread's calls all counted as nested in it from then on (an engine with no
                # CUDA signal for its whole life, 1 run in ~20).
                for ret in (True, False):
                    self.obj.attach_uprobe(
                        "cuda_exit" if ret else "cuda_enter",
                        path,
                        probe.offset,
                        cookie=FN_ID[name],
                        retprobe=ret,
                    )
                rep.attached.append(probe)
            except libbpf.BpfError as e:
                rep.error = str(e)
                log.warning("attach %s:%s failed: %s", path, name, e)
        log.info("%s: %d function(s) traced, %d skipped", path, len(rep.attached), len(rep.skipped))
        return rep

    def read(self) -> dict[tuple[int, str], CallStats]:
        out: dict[tuple[int, str], CallStats] = {}
        for k, v in libbpf.items(self._calls, CallKey, CallHist):
            assert isinstance(v, CallHist)
            if k.fn < len(FUNCTIONS):
                out[(k.pid, FUNCTIONS[k.fn])] = CallStats(
                    int(v.count), int(v.sum_ns), list(v.slots)
                )
        return out

    def forget(self, pids: set[int]) -> None:
        for k, _ in list(libbpf.items(self._calls, CallKey, CallHist)):
            if k.pid in pids:
                libbpf.delete(self._calls, k)

    def close(self) -> None:
        self.obj.close()
