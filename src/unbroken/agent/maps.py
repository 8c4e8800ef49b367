"""ctypes mirrors of bpf/agent.h (a test checks their sizes against the C layouts)."""

from __future__ import annotations

import ctypes

__all__ = ["MAX_SLOTS", "CallHist", "CallKey", "SockState", "StartVal", "TcpClock", "TcpStats"]

MAX_SLOTS = 40
u32, u64 = ctypes.c_uint32, ctypes.c_uint64


class StartVal(ctypes.Structure):
    _fields_ = [("ts", u64), ("fn", u32), ("depth", u32)]


class CallKey(ctypes.Structure):
    _fields_ = [("pid", u32), ("fn", u32)]


class CallHist(ctypes.Structure):
    _fields_ = [("count", u64), ("sum_ns", u64), ("slots", u64 * MAX_SLOTS)]


class SockState(ctypes.Structure):
    _fields_ = [
        ("pid", u32),
        ("permille", u32),
        ("base_rwnd", u32),
        ("base_sndbuf", u32),
        ("rwnd", u32),
        ("sndbuf", u32),
    ]


class TcpStats(ctypes.Structure):
    _fields_ = [
        ("sends", u64),
        ("closed_rwnd", u64),
        ("closed_sndbuf", u64),
        ("peak_permille", u64),
    ]


class TcpClock(ctypes.Structure):
    _fields_ = [("hz", u64), ("jiffies", u64), ("ktime_ns", u64)]
