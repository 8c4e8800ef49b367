"""TCP backpressure per process: the time its sockets were held back by a peer that does not
read (receive-window limited) or by a full send buffer (send-buffer limited), as the kernel
itself accounts it (tcp_sock's chrono, reported by tcp_info as tcpi_rwnd_limited and
tcpi_sndbuf_limited). Read by the BPF programs, or, without eBPF, by sampling
NETLINK_SOCK_DIAG (INET_DIAG_INFO and INET_DIAG_SKMEMINFO): the same quantities either way."""

from __future__ import annotations

import ctypes
import gzip
import os
import platform
import socket
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from unbroken.agent import libbpf
from unbroken.agent.maps import SockState, TcpClock, TcpStats

__all__ = ["SockDiagSampler", "TcpProc", "TcpTracer", "kernel_hz"]

FINAL_KEEP = 4096  # forgotten processes' last readings kept for the next scrape, at most
# The socket map's values as numpy reads them (struct sock_state: six __u32).
_SOCK = np.dtype([(name, np.uint32) for name, _ in SockState._fields_])
assert _SOCK.itemsize == ctypes.sizeof(SockState)


@dataclass
class TcpProc:
    fill_ratio: float  # sk_wmem_queued / sk_sndbuf now, max over the process's open sockets
    peak_ratio: float  # highest fill ratio seen (at a send or a read)
    backpressure_s: float  # socket-seconds receive-window or send-buffer limited
    sends: int = 0
    rwnd_limited_s: float | None = None  # the receive-window-limited part of backpressure_s


def _pid_alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def kernel_hz() -> int | None:
    """CONFIG_HZ from the kernel's config (/proc/config.gz, /boot/config-RELEASE); None when
    neither exists. The chrono counts jiffies: seconds need the kernel's HZ, not USER_HZ."""
    for path, opener in (
        ("/proc/config.gz", gzip.open),
        (f"/boot/config-{platform.release()}", open),
    ):
        try:
            with opener(path, "rt") as f:  # type: ignore[operator]
                for line in f:
                    if line.startswith("CONFIG_HZ="):
                        return int(line.split("=", 1)[1])
        except (OSError, ValueError):
            continue
    return None


class TcpTracer:
    """Reads the BPF side (bpf/tcp.bpf.c): at each read the `collect` program refreshes every
    open socket's chrono in the kernel, so a stall counts while it lasts."""

    source = "ebpf"

    def __init__(self, obj_path: Path, threshold: float) -> None:
        self.threshold = threshold  # the fill ratio that makes an unknown process exported
        self.obj = libbpf.Object(obj_path)
        self.obj.load()
        self.obj.attach("on_sendmsg")
        self.obj.attach("on_state")
        self._fd = self.obj.map_fd("tcp_pids")
        self._socks = self.obj.map_fd("socks")
        self._clock = self.obj.map_fd("clock")
        self._last: dict[int, TcpProc] = {}
        self._final: dict[int, TcpProc] = {}
        self._hint = 1024  # sockets the next batch read expects (the last read's + room)
        self.hz = self._measure_hz()

    def _clock_now(self) -> TcpClock:
        self.obj.run("collect")
        for _, v in libbpf.items(self._clock, ctypes.c_uint32, TcpClock):
            assert isinstance(v, TcpClock)
            return v
        raise libbpf.BpfError("clock map empty", 2)

    def _measure_hz(self) -> int:
        """The kernel's HZ: libbpf's CONFIG_HZ (the kernel config), else our own reading of
        it, else measured: jiffies against ktime over 0.2 s, rounded to a HZ Linux offers."""
        c = self._clock_now()
        if c.hz:
            return int(c.hz)
        hz = kernel_hz()
        if hz:
            return hz
        time.sleep(0.2)
        d = self._clock_now()
        rate = (d.jiffies - c.jiffies) / max(1e-9, (d.ktime_ns - c.ktime_ns) / 1e9)
        return min((100, 250, 300, 1000), key=lambda h: abs(h - rate))

    def _snapshot(self) -> dict[int, TcpProc]:
        self.obj.run("collect")
        # tcp_pids before socks: a socket closing in between is then missed once (its time
        # neither closed nor open yet), which the clamp below holds, rather than counted
        # twice and taken back at the next read (a counter going down).
        per_pid: dict[int, TcpStats] = {}
        for k, v in libbpf.items(self._fd, ctypes.c_uint32, TcpStats):
            assert isinstance(v, TcpStats)
            per_pid[int(k.value)] = v
        live = self._live()
        out: dict[int, TcpProc] = {}
        for pid, v in per_pid.items():
            r, s, permille = live.get(pid, (0, 0, 0))
            rwnd_s = (v.closed_rwnd + r) / self.hz
            bp_s = rwnd_s + (v.closed_sndbuf + s) / self.hz
            fill = min(1.0, permille / 1000)
            t = TcpProc(
                fill, max(fill, min(1.0, v.peak_permille / 1000)), bp_s, int(v.sends), rwnd_s
            )
            prev = self._last.get(pid)
            if prev is not None:  # counters: never backwards
                t.backpressure_s = max(t.backpressure_s, prev.backpressure_s)
                t.rwnd_limited_s = max(rwnd_s, prev.rwnd_limited_s or 0.0)
                t.peak_ratio = max(t.peak_ratio, prev.peak_ratio)
            out[pid] = self._last[pid] = t
        return out

    def _socks_now(self) -> tuple[np.ndarray, np.ndarray]:
        """The open sockets' keys and states (`libbpf.dump`: a few batch reads). A node runs
        thousands of sockets and the controller reads five times a second: entry by entry
        that was 6 us a socket (50 ms a read at 8,000), most of the agent's CPU."""
        keys, vals = libbpf.dump(self._socks, ctypes.c_uint64, SockState, hint=self._hint)
        self._hint = len(keys) // ctypes.sizeof(ctypes.c_uint64) + 1024
        return np.frombuffer(keys, dtype=np.uint64), np.frombuffer(vals, dtype=_SOCK)

    def _live(self) -> dict[int, tuple[int, int, int]]:
        """Per pid: its open sockets' receive-window and send-buffer limited jiffies since
        first sight, summed, and their highest fill (permille)."""
        a = self._socks_now()[1]
        if not len(a):
            return {}
        pids, at = np.unique(a["pid"], return_inverse=True)
        # float64 sums of u32s are exact up to 2**53: the map's 65,536 sockets x 2**32 fit.
        rwnd = np.bincount(at, weights=a["rwnd"], minlength=len(pids))
        sndbuf = np.bincount(at, weights=a["sndbuf"], minlength=len(pids))
        top = np.zeros(len(pids), dtype=np.uint32)
        np.maximum.at(top, at, a["permille"])
        return {
            int(p): (int(r), int(b), int(m))
            for p, r, b, m in zip(
                pids.tolist(), rwnd.tolist(), sndbuf.tolist(), top.tolist(), strict=True
            )
        }

    def read(self) -> dict[int, TcpProc]:
        """Per pid; a process forgotten since the last read appears once more with its final
        values, so what it accrued up to its exit reaches the exporter's sums."""
        out = self._snapshot()
        for pid, t in self._final.items():
            out.setdefault(pid, t)
        self._final.clear()
        return out

    def forget(self, pids: Iterable[int]) -> None:
        pids = set(pids)
        if not pids:
            return
        snap = self._snapshot()
        for pid in pids:
            if pid in snap:
                self._final[pid] = replace(snap[pid], fill_ratio=0.0)
            self._last.pop(pid, None)
            libbpf.delete(self._fd, ctypes.c_uint32(pid))
        keys, states = self._socks_now()
        gone = np.isin(states["pid"], np.fromiter(pids, dtype=np.uint32, count=len(pids)))
        for k in keys[gone].tolist():
            libbpf.delete(self._socks, ctypes.c_uint64(k))
        while len(self._final) > FINAL_KEEP:
            del self._final[next(iter(self._final))]

    def prune(self) -> set[int]:
        """Forget every process in the maps that has exited, known to discovery or not: the
        maps are bounded (BPF_NOEXIST fails when full) and a dead pid's series must end."""
        dead = {
            int(k.value)
            for k in libbpf.keys(self._fd, ctypes.c_uint32)
            if not _pid_alive(int(k.value))
        }
        self.forget(dead)
        return dead

    def close(self) -> None:
        self.obj.close()


# -- sock_diag fallback ------------------------------------------------------------------
NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_DONE, NLMSG_ERROR = 3, 2
INET_DIAG_INFO, INET_DIAG_SKMEMINFO = 2, 7
SK_MEMINFO_SNDBUF, SK_MEMINFO_WMEM_QUEUED = 3, 5
TCPI_RWND_LIMITED = 176  # offset of tcpi_rwnd_limited (u64, µs) in struct tcp_info
TCPI_SNDBUF_LIMITED = 184  # tcpi_sndbuf_limited (u64, µs), right after it


def _socket_inodes() -> dict[int, int]:
    """socket inode → pid, from /proc/*/fd."""
    out: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            for fd in os.listdir(f"/proc/{d}/fd"):
                try:
                    target = os.readlink(f"/proc/{d}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith("socket:["):
                    out[int(target[8:-1])] = int(d)
        except OSError:
            continue
    return out


def dump_tcp() -> list[tuple[int, int, int, tuple[int, int] | None]]:
    """(inode, wmem_queued, sndbuf, (rwnd_limited_us, sndbuf_limited_us)) for every TCP
    socket of this network namespace."""
    out = []
    for family in (socket.AF_INET, socket.AF_INET6):
        ext = (1 << (INET_DIAG_INFO - 1)) | (1 << (INET_DIAG_SKMEMINFO - 1))
        req = struct.pack("=BBBxI", family, socket.IPPROTO_TCP, ext, 0xFFF) + b"\0" * 48
        msg = (
            struct.pack(
                "=IHHII", 16 + len(req), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, 1, 0
            )
            + req
        )
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG) as s:
            s.sendto(msg, (0, 0))
            done = False
            while not done:
                data = s.recv(1 << 16)
                off = 0
                while off + 16 <= len(data):
                    ln, typ = struct.unpack_from("=IH", data, off)
                    if typ in (NLMSG_DONE, NLMSG_ERROR) or ln < 16:
                        done = True
                        break
                    body = data[off + 16 : off + ln]
                    inode = struct.unpack_from("=I", body, 68)[0]
                    wq = sb = 0
                    chrono = None
                    a = 72
                    while a + 4 <= len(body):
                        alen, atype = struct.unpack_from("=HH", body, a)
                        if alen < 4:
                            break
                        payload = body[a + 4 : a + alen]
                        if atype == INET_DIAG_SKMEMINFO and len(payload) >= 24:
                            mem = struct.unpack_from("=9I", payload.ljust(36, b"\0"))
                            wq, sb = mem[SK_MEMINFO_WMEM_QUEUED], mem[SK_MEMINFO_SNDBUF]
                        elif atype == INET_DIAG_INFO and len(payload) >= TCPI_SNDBUF_LIMITED + 8:
                            chrono = struct.unpack_from("=QQ", payload, TCPI_RWND_LIMITED)
                        a += (alen + 3) & ~3
                    out.append((inode, wq, sb, chrono))
                    off += (ln + 3) & ~3
    return out


class SockDiagSampler:
    """Without eBPF: sample every socket's tcp_info and send queue each interval and attribute
    them to their process. Backpressure is the same kernel chrono the BPF side reads (only its
    increase since the socket was first sampled counts); a socket that closes between two
    samples loses its last interval."""

    source = "sock_diag"

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold
        self.procs: dict[int, TcpProc] = {}
        self._chrono: dict[int, tuple[int, int]] = {}  # inode → last (rwnd, sndbuf) µs

    def sample(self) -> None:
        owners = _socket_inodes()
        latest: dict[int, float] = {}
        seen: set[int] = set()
        for inode, wq, sb, chrono in dump_tcp():
            pid = owners.get(inode)
            if pid is None or sb <= 0:
                continue
            seen.add(inode)
            ratio = min(1.0, wq / sb)  # wmem_queued may overshoot sndbuf by one skb
            p = self.procs.setdefault(pid, TcpProc(0.0, 0.0, 0.0, 0, 0.0))
            latest[pid] = max(latest.get(pid, 0.0), ratio)
            p.peak_ratio = max(p.peak_ratio, ratio)
            p.sends += 1
            if chrono is not None:
                r0, s0 = self._chrono.get(inode, chrono)
                dr, ds = max(0, chrono[0] - r0) / 1e6, max(0, chrono[1] - s0) / 1e6
                p.rwnd_limited_s = (p.rwnd_limited_s or 0.0) + dr
                p.backpressure_s += dr + ds
                self._chrono[inode] = chrono
        for inode in set(self._chrono) - seen:  # closed sockets
            del self._chrono[inode]
        for pid, p in self.procs.items():
            p.fill_ratio = latest.get(pid, 0.0)

    def read(self) -> dict[int, TcpProc]:
        return dict(self.procs)

    def forget(self, pids: Iterable[int]) -> None:
        for pid in pids:
            self.procs.pop(pid, None)

    def prune(self) -> set[int]:
        dead = {pid for pid in self.procs if not _pid_alive(pid)}
        self.forget(dead)
        return dead

    def close(self) -> None:
        pass
