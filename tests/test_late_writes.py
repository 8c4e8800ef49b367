"""First tokens before later ones (`gateway/_late_writes.py`): when one pass of the
gateway's event loop reads a new stream's first event and another stream's later tokens, the
new stream's first bytes reach its client before the other's.

Real processes and sockets: a simulator engine, `unbroken gateway`, two raw HTTP clients.
The gateway is stopped (SIGSTOP) while the engine produces the new stream's first token and
the old stream's next ones, so that both are waiting when it runs again (SIGCONT) and one
poll reports both sockets. The clients' kernel receive timestamps (SO_TIMESTAMPNS) of the
first byte after that say which write came first. Before the change, the old stream's tokens
were written inside the read callback, and the new stream's first event (written by its task,
with the response headers) after all of them.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import time
from pathlib import Path

import orjson
from tests.helpers import MODEL, engine, gateway, metric

# Linux's SO_TIMESTAMPNS (= SCM_TIMESTAMPNS, a struct timespec per read); Python 3.11's socket
# module does not name it.
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)


def _open(port: int, body: dict[str, object]) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    data = orjson.dumps(body)
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (len(data), data)
    )
    s.setblocking(False)
    return s


def _drain(s: socket.socket) -> bytes:
    got = []
    while True:
        try:
            data = s.recv(65536)
        except BlockingIOError:
            return b"".join(got)
        if not data:
            return b"".join(got)
        got.append(data)


def _first_byte_ns(s: socket.socket, timeout: float = 5.0) -> int:
    """The kernel's receive time of the next byte (one byte read: TCP reports the time of
    the last segment a read copies from)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            data, anc, _, _ = s.recvmsg(1, socket.CMSG_SPACE(16))
        except BlockingIOError:
            assert time.monotonic() < deadline, "no byte came"
            time.sleep(0.005)
            continue
        assert data, "connection closed"
        for level, kind, d in anc:
            if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
                sec, ns = struct.unpack("qq", d[:16])
                return sec * 1_000_000_000 + ns
        raise AssertionError("no receive timestamp")


def _wait(cond: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_a_first_token_is_written_before_later_tokens_read_in_the_same_pass(
    tmp_path: Path,
) -> None:
    # Steps of 20 ms; a prompt of ~300 tokens prefills in ~0.6 s.
    e = engine(
        tmp_path,
        "--decode-base-s",
        "0.02",
        "--decode-per-seq-s",
        "0",
        "--prefill-per-token-s",
        "0.002",
        fast=False,
    )
    g = gateway(tmp_path, e.url)
    a = b = None
    try:
        a = _open(g.port, {"model": MODEL, "prompt": "go", "max_tokens": 400, "stream": True})
        _wait(lambda: a is not None and b"data:" in _peek(a))
        ttft0 = metric(e.url, "vllm:time_to_first_token_seconds_count")
        prompt = " ".join(f"w{i}" for i in range(300))
        sent = time.monotonic()
        b = _open(g.port, {"model": MODEL, "prompt": prompt, "max_tokens": 2, "stream": True})
        # B is at the engine (the gateway forwards it in a few ms), in its prefill (~0.65 s
        # alone): stop the gateway.
        time.sleep(max(0.0, sent + 0.2 - time.monotonic()))
        os.killpg(g.pid, signal.SIGSTOP)
        try:
            time.sleep(0.05)
            _drain(a)  # what A had before the stop
            assert _drain(b) == b"", "B's answer began before the stop: prefill too short"
            # B's first token made by the engine; A's later tokens after it.
            _wait(lambda: metric(e.url, "vllm:time_to_first_token_seconds_count") > ttft0, 5.0)
            time.sleep(0.1)
        finally:
            os.killpg(g.pid, signal.SIGCONT)
        b_ns, a_ns = _first_byte_ns(b), _first_byte_ns(a)
        gap_us = (b_ns - a_ns) / 1e3
        assert b_ns < a_ns, f"A's later tokens went out {gap_us:.0f} us before B's first"
        # Both streams go on whole.
        time.sleep(0.3)
        assert b"[DONE]" in _drain(b)
        assert b"data:" in _drain(a)
    finally:
        for s in (a, b):
            if s is not None:
                s.close()
        g.stop()
        e.stop()


_seen: dict[int, bytes] = {}


def _peek(s: socket.socket) -> bytes:
    _seen[s.fileno()] = _seen.get(s.fileno(), b"") + _drain(s)
    return _seen[s.fileno()]
