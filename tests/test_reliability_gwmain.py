"""kill -9 of the gateway's main process (issue 21, finding 5): the workers finish every
stream, and the restarted gateway takes the very same listening socket, so no connection is
refused. The restart is simulated as the supervisor (`pipeline/supervisor.py`
`_watch_gateway`) does it: a second gateway process with the same settings and ports.
Real engine (simulator), real gateway processes, real sockets."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from helpers import TOKEN, Proc, admin, engine, free_port, wait_endpoints
from test_gateway_workers import stream_text
from unbroken.engine.textmodel import expected_completion

N_STREAMS = 16
MAX_TOKENS = 500  # ~5 s at 10 ms a step: in flight through the whole restart


def _gateway_proc(tmp: Path, port: int, admin_port: int, endpoint: str | None, name: str) -> Proc:
    argv = [
        *[sys.executable, "-m", "unbroken", "gateway", "--port", str(port)],
        *["--admin-port", str(admin_port), "--workers", "2"],
        *(["--endpoint", endpoint] if endpoint else []),
    ]
    return Proc(
        argv, port, tmp / f"{name}.log", env={"UNBROKEN_ADMIN_TOKEN": TOKEN}, admin_port=admin_port
    )


class Knocker(threading.Thread):
    """Connects in a loop and asks /health, counting refused and reset connections."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.stop = threading.Event()
        self.refused = self.reset = self.ok = 0

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=10) as s:
                    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    if not s.recv(64).startswith(b"HTTP/1.1 "):
                        self.reset += 1
                    else:
                        self.ok += 1
            except ConnectionRefusedError:
                self.refused += 1
            except (ConnectionResetError, TimeoutError, BrokenPipeError):
                self.reset += 1
            time.sleep(0.002)


def _try(url: str, prompt: str) -> str | None:
    try:
        text, err = stream_text(url, prompt, MAX_TOKENS)
    except (httpx.HTTPError, AssertionError):
        return None
    return None if err is not None else text


def _register(p: Proc, url: str) -> None:
    """As the supervisor does after a restart: the engine, through the admin API."""
    deadline = time.monotonic() + 20
    while True:
        try:
            r = admin(p, "POST", "/admin/endpoints", {"url": url})
            assert r.status_code < 300, r.text
            return
        except httpx.TransportError:
            assert time.monotonic() < deadline, p.tail()
            time.sleep(0.05)


@pytest.mark.parametrize("registered", ["static", "by-admin-api"])
def test_kill9_of_main_process_breaks_no_stream_and_refuses_no_connection(
    tmp_path: Path, registered: str
) -> None:
    """`static`: the restarted gateway has the engine on its command line; `by-admin-api`:
    it starts with none and gets it through the admin API afterwards, as the supervisor's
    restart does (its public port is answered by the orphans meanwhile)."""
    eng = engine(tmp_path, "--decode-base-s", "0.01")
    port, admin_port = free_port(), free_port()
    endpoint = eng.url
    old = _gateway_proc(tmp_path, port, admin_port, endpoint, "gw-old").start()
    new: Proc | None = None
    knock = Knocker(port)
    try:
        wait_endpoints(old, lambda eps: any(e["state"] == "ready" for e in eps))
        with ThreadPoolExecutor(N_STREAMS) as pool:
            jobs = [pool.submit(_try, old.url, f"kill main {i}") for i in range(N_STREAMS)]
            time.sleep(1.0)  # every stream is under way
            knock.start()
            time.sleep(0.2)
            os.kill(old.pid, signal.SIGKILL)
            old.popen.wait()  # type: ignore[union-attr]
            time.sleep(0.3)  # the supervisor notices, then starts the gateway again
            late = registered == "by-admin-api"
            new = _gateway_proc(tmp_path, port, admin_port, None if late else endpoint, "gw-new")
            new.start()
            if late:
                _register(new, endpoint)
            results = [j.result() for j in jobs]
        time.sleep(0.5)
        knock.stop.set()
        knock.join()
        want = [expected_completion(f"kill main {i}", MAX_TOKENS).text for i in range(N_STREAMS)]
        broken = [i for i in range(N_STREAMS) if results[i] != want[i]]
        assert broken == [], f"{len(broken)} of {N_STREAMS} streams broken or altered"
        assert (knock.refused, knock.reset) == (0, 0), (knock.refused, knock.reset, knock.ok)
        assert knock.ok > 0
        # The new gateway serves, and the orphaned workers are gone once their streams ended.
        text, err = stream_text(new.url, "after", 20)
        assert err is None and text == expected_completion("after", 20).text
    finally:
        knock.stop.set()
        if new is not None:
            new.stop()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(old.pid, signal.SIGKILL)  # orphaned workers left over by a failure
        eng.stop()
