"""CUDA call timing: attach the uprobe pair to each CUDA library the agent finds, read the
in-kernel histograms."""

from __future__ import annotations

import errno
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
FINAL_KEEP = 4096  # forgotten (pid, function) readings kept for the next scrape, at most


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
    links: list[libbpf.Link] = field(default_factory=list, repr=False)
    key: tuple[int, int] = (0, 0)  # (st_dev, st_ino) of the file


MULTI = ("cuda_enter_multi", "cuda_exit_multi")
# Why a multi-uprobe link could not be made: the kernel (before 6.6: EINVAL at load or link
# time) or its configuration (EOPNOTSUPP, ENOSYS): the agent then attaches probe by probe.
_NO_MULTI = (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS, 524)  # 524: ENOTSUPP (kernel)


class CudaTracer:
    def __init__(self, obj_path: Path, *, allow_slow: bool = False, multi: bool = True) -> None:
        """`multi`: one multi-uprobe link per library and direction where the kernel has
        them (6.6+), so that tearing a library's probes down pays one grace period per link
        instead of one per probe (~0.11 s each, docs/agent.md); else a link per probe."""
        self.obj = libbpf.Object(obj_path)
        self.multi = multi
        if multi:
            for prog in MULTI:
                self.obj.set_expected_attach_type(prog, libbpf.BPF_TRACE_UPROBE_MULTI)
            try:
                self.obj.load()
            except libbpf.BpfError as e:
                self.obj.close()
                if e.errno not in _NO_MULTI:
                    raise  # EPERM and the like: the caller names what is missing
                # a kernel without them may refuse the attach type at load
                log.info("multi-uprobe programs not loadable (%s): one link per probe", e)
                self.multi = False
        if not self.multi:
            self.obj = libbpf.Object(obj_path)
            for prog in MULTI:
                self.obj.set_autoload(prog, False)
            self.obj.load()
        self.allow_slow = allow_slow
        self.libraries: dict[tuple[int, int], LibraryProbes] = {}
        self._calls = self.obj.map_fd("calls")
        self._final: dict[tuple[int, str], CallStats] = {}

    def attach_library(self, path: str) -> LibraryProbes | None:
        """Attach to every traced function `path` exports (once per file: uprobes follow the
        inode into every process that maps it, present and future)."""
        st = os.stat(path)
        key = (st.st_dev, st.st_ino)
        if key in self.libraries:
            return None
        rep = LibraryProbes(path, key=key)
        self.libraries[key] = rep
        try:
            found = function_offsets(Path(path), set(FUNCTIONS))
        except (OSError, ValueError) as e:
            rep.error = str(e)
            log.warning("cannot read %s: %s", path, e)
            return rep
        probes = []
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
            probes.append(probe)
        if probes and self.multi and self._attach_multi(rep, probes):
            log.info("%s: %d function(s) traced (2 multi-uprobe links), %d skipped",
                     path, len(rep.attached), len(rep.skipped))  # fmt: skip
            return rep
        for probe in probes:
            name = probe.function
            pair: list[libbpf.Link] = []
            try:
                # The return probe first: one attached after the entry probe let a call that
                # entered in between open a per-thread record no return would close, and the
                # thread's calls all counted as nested in it from then on (an engine with no
                # CUDA signal for its whole life, 1 run in ~20).
                for ret in (True, False):
                    pair.append(
                        self.obj.attach_uprobe(
                            "cuda_exit" if ret else "cuda_enter",
                            path,
                            probe.offset,
                            cookie=FN_ID[name],
                            retprobe=ret,
                        )
                    )
                rep.links.extend(pair)
                rep.attached.append(probe)
            except libbpf.BpfError as e:
                self.obj.destroy(pair)  # a return probe without its entry counts nothing
                rep.error = str(e)
                log.warning("attach %s:%s failed: %s", path, name, e)
        log.info("%s: %d function(s) traced, %d skipped", path, len(rep.attached), len(rep.skipped))
        return rep

    def _attach_multi(self, rep: LibraryProbes, probes: list[Probe]) -> bool:
        """Every probe of the library in two links (returns, then entries: see the per-probe
        order below). False when the kernel has no multi-uprobe links: from then on the agent
        attaches probe by probe."""
        offsets = [p.offset for p in probes]
        cookies = [FN_ID[p.function] for p in probes]
        links: list[libbpf.Link] = []
        try:
            for ret in (True, False):
                links.append(
                    self.obj.attach_uprobe_multi(
                        "cuda_exit_multi" if ret else "cuda_enter_multi",
                        rep.path,
                        offsets,
                        cookies,
                        retprobe=ret,
                    )
                )
        except libbpf.BpfError as e:
            self.obj.destroy(links)
            if e.errno in _NO_MULTI:
                log.info("no multi-uprobe links here (%s): one link per probe", e)
                self.multi = False
                return False
            # Not rep.error: the probes attached one by one next decide whether it failed.
            log.warning("attach %s failed: %s; trying probe by probe", rep.path, e)
            return False
        rep.links.extend(links)
        rep.attached.extend(probes)
        return True

    def detach(self, keys: set[tuple[int, int]]) -> list[LibraryProbes]:
        """Destroy the links of these library files (no live process maps them): a long-lived
        agent must not hold the probes of every copy it ever saw, and each link costs about
        0.1 s to tear down (a kernel grace period per uprobe) at exit."""
        gone = []
        for key in keys:
            rep = self.libraries.pop(key, None)
            if rep is None:
                continue
            self.obj.destroy(rep.links)
            rep.links.clear()
            gone.append(rep)
            log.info("%s: no process maps it any more; probes detached", rep.path)
        return gone

    def _entries(self) -> list[tuple[CallKey, CallStats]]:
        out = []
        for k, v in libbpf.items(self._calls, CallKey, CallHist):
            assert isinstance(v, CallHist)
            out.append((k, CallStats(int(v.count), int(v.sum_ns), list(v.slots))))
        return out

    def read(self) -> dict[tuple[int, str], CallStats]:
        """Per (pid, function); a process forgotten since the last read appears once more
        with its final counts, so calls it made after the last scrape are not lost."""
        out = dict(self._final)
        self._final.clear()
        for k, st in self._entries():
            if k.fn < len(FUNCTIONS):
                out[(k.pid, FUNCTIONS[k.fn])] = st
        return out

    def forget(self, pids: set[int]) -> None:
        for k, st in self._entries():
            if k.pid in pids:
                if k.fn < len(FUNCTIONS):
                    self._final[(k.pid, FUNCTIONS[k.fn])] = st
                libbpf.delete(self._calls, k)
        while len(self._final) > FINAL_KEEP:
            del self._final[next(iter(self._final))]

    def prune(self) -> set[int]:
        """Forget every exited process in the map, whether discovery knew it or not."""
        dead = {
            k.pid for k in libbpf.keys(self._calls, CallKey) if not os.path.exists(f"/proc/{k.pid}")
        }
        if dead:
            self.forget(dead)
        return dead

    def close(self) -> None:
        self.obj.close()
