"""TCP send-buffer backpressure per process: from the BPF tracepoint program, or, without
eBPF, by sampling NETLINK_SOCK_DIAG (INET_DIAG_SKMEMINFO and tcp_info)."""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from unbroken.agent import libbpf
from unbroken.agent.maps import TcpStats

__all__ = ["SockDiagSampler", "TcpProc", "TcpTracer"]


@dataclass
class TcpProc:
    fill_ratio: float  # latest sk_wmem_queued / sk_sndbuf (max over the process's sockets)
    peak_ratio: float
    backpressure_s: float  # socket-seconds at or above the threshold
    sends: int = 0
    rwnd_limited_s: float | None = None  # sock_diag only: time the peer's window limited us


class TcpTracer:
    source = "ebpf"

    def __init__(self, obj_path: Path, threshold: float) -> None:
        self.obj = libbpf.Object(obj_path)
        self.obj.set_rodata(struct.pack("<I", int(threshold * 1000)))
        self.obj.load()
        self.obj.attach("on_sendmsg")
        self.obj.attach("on_state")
        self._fd = self.obj.map_fd("tcp_pids")

    def read(self) -> dict[int, TcpProc]:
        out = {}
        for k, v in libbpf.items(self._fd, ctypes.c_uint32, TcpStats):
            assert isinstance(v, TcpStats)
            out[int(k.value)] = TcpProc(
                v.last_permille / 1000, v.peak_permille / 1000, v.above_ns / 1e9, int(v.sends)
            )
        return out

    def forget(self, pids: set[int]) -> None:
        for k, _ in list(libbpf.items(self._fd, ctypes.c_uint32, TcpStats)):
            if int(k.value) in pids:
                libbpf.delete(self._fd, k)

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


def dump_tcp() -> list[tuple[int, int, int, int | None]]:
    """(inode, wmem_queued, sndbuf, rwnd_limited_us) for every TCP socket."""
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
                    rwnd = None
                    a = 72
                    while a + 4 <= len(body):
                        alen, atype = struct.unpack_from("=HH", body, a)
                        if alen < 4:
                            break
                        payload = body[a + 4 : a + alen]
                        if atype == INET_DIAG_SKMEMINFO and len(payload) >= 24:
                            mem = struct.unpack_from("=9I", payload.ljust(36, b"\0"))
                            wq, sb = mem[SK_MEMINFO_WMEM_QUEUED], mem[SK_MEMINFO_SNDBUF]
                        elif atype == INET_DIAG_INFO and len(payload) >= TCPI_RWND_LIMITED + 8:
                            rwnd = struct.unpack_from("=Q", payload, TCPI_RWND_LIMITED)[0]
                        a += (alen + 3) & ~3
                    out.append((inode, wq, sb, rwnd))
                    off += (ln + 3) & ~3
    return out


class SockDiagSampler:
    """Without eBPF: sample every socket's send queue and attribute it to its process.
    Time at or above the threshold is counted by interval (coarser than the tracepoint)."""

    source = "sock_diag"

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold
        self.procs: dict[int, TcpProc] = {}
        self._last = time.monotonic()
        self._rwnd: dict[int, int] = {}  # inode → last tcpi_rwnd_limited

    def sample(self) -> None:
        now = time.monotonic()
        dt = now - self._last
        self._last = now
        owners = _socket_inodes()
        latest: dict[int, float] = {}
        for inode, wq, sb, rwnd in dump_tcp():
            pid = owners.get(inode)
            if pid is None or sb <= 0:
                continue
            ratio = wq / sb
            p = self.procs.setdefault(pid, TcpProc(0.0, 0.0, 0.0, 0, 0.0))
            latest[pid] = max(latest.get(pid, 0.0), ratio)
            p.peak_ratio = max(p.peak_ratio, ratio)
            p.sends += 1
            if ratio >= self.threshold:
                p.backpressure_s += dt
            if rwnd is not None:
                prev = self._rwnd.get(inode, rwnd)
                p.rwnd_limited_s = (p.rwnd_limited_s or 0.0) + max(0, rwnd - prev) / 1e6
                self._rwnd[inode] = rwnd
        for pid, p in self.procs.items():
            p.fill_ratio = latest.get(pid, 0.0)

    def read(self) -> dict[int, TcpProc]:
        return dict(self.procs)

    def forget(self, pids: set[int]) -> None:
        for pid in pids:
            self.procs.pop(pid, None)

    def close(self) -> None:
        pass
