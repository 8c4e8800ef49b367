"""Test helpers: real processes on real sockets."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from unbroken.gateway._pool import Endpoint, State
from unbroken.wire.http import free_port
from unbroken.wire.sse import SSEDecoder

TOKEN = "test-admin-token"
MODEL = "unbroken-sim"
# Fast steps keep the suite quick; tests about timing pass their own.
FAST = [
    "--decode-base-s",
    "0.004",
    "--decode-per-seq-s",
    "0.00005",
    "--prefill-per-token-s",
    "0.00001",
]


def _listeners(port: int) -> set[int]:
    """Inodes of the TCP sockets listening on `port` (IPv4 and IPv6)."""
    found: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                f = line.split()
                if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                    found.add(int(f[9]))
    return found


def _ours(port: int, root: int) -> bool:
    """Whether the socket listening on `port` is held by `root` or one of its descendants.
    True where it cannot tell (no listener found, /proc unreadable). Only the started
    process's own tree is read (its `children` files), not every process on the machine."""
    inodes = _listeners(port)
    if not inodes:
        return True
    links = {f"socket:[{i}]" for i in inodes}
    return any(_holds(Path(f"/proc/{pid}"), links) for pid in _tree(root))


def _tree(root: int) -> list[int]:
    """`root` and its descendants, from /proc/PID/task/TID/children."""
    pids = [root]
    for pid in pids:  # grows as it goes
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{pid}/task").iterdir():
                with contextlib.suppress(OSError):
                    pids += map(int, (task / "children").read_text().split())
    return pids


def _holds(proc: Path, links: set[str]) -> bool:
    try:
        fds = list((proc / "fd").iterdir())
    except OSError:
        return False
    for fd in fds:
        with contextlib.suppress(OSError):
            if os.readlink(fd) in links:
                return True
    return False


@dataclass
class Proc:
    argv: list[str]
    port: int
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    popen: subprocess.Popen[bytes] | None = None
    admin_port: int | None = None
    moves: int = 0  # times `start` took new ports (`_move_port`)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def start(self, health: str = "/health", timeout: float = 30.0) -> Proc:
        out = open(self.log, "ab")
        self.popen = subprocess.Popen(
            self.argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.env},
            start_new_session=True,
        )
        out.close()
        deadline = time.monotonic() + timeout
        while True:
            if self.popen.poll() is not None:
                if self.moves < 3 and "the port is already in use" in self.tail(5):
                    # Another process bound one of our ports between `free_port` and our
                    # bind (a full suite met it: a gateway's admin port): new ports.
                    self._move_port()
                    return self.start(health, max(deadline - time.monotonic(), 5.0))
                raise RuntimeError(f"{self.argv} exited {self.popen.returncode}:\n{self.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + health, timeout=1).status_code == 200:
                    if _ours(self.port, self.popen.pid):
                        return self
                    self._move_port()
                    return self.start(health, max(deadline - time.monotonic(), 5.0))
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.argv} not healthy:\n{self.tail()}")
            time.sleep(0.05)

    def _move_port(self) -> None:
        """Another process answered on our port, or took one of ours before we bound it: the
        other xdist worker's server picked the same free port and bound it first (CI met this
        once: a test read a gateway's /metrics for its engine's). Ours cannot listen there;
        stop it and take new ports (the admin port too: either may be the one taken)."""
        assert self.popen is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait()
        self.moves += 1
        new = {str(self.port): str(port := free_port())}
        self.port = port
        if self.admin_port is not None:
            new[str(self.admin_port)] = str(admin := free_port())
            self.admin_port = admin
        self.argv = [new.get(a, a) for a in self.argv]

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def signal(self, sig: int) -> None:
        if self.popen is not None and self.popen.poll() is None:
            os.kill(self.popen.pid, sig)

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        return self.popen.returncode


def engine(
    tmp: Path,
    *args: str,
    name: str = "engine",
    fast: bool = True,
    token: str | None = TOKEN,
    env: dict[str, str] | None = None,
) -> Proc:
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "unbroken",
        "engine",
        "--port",
        str(port),
        *(FAST if fast else []),
        *args,
    ]
    env = {**(env or {}), "UNBROKEN_ADMIN_TOKEN": token or ""}
    return Proc(argv, port, tmp / f"{name}-{port}.log", env=env).start()


def gateway(
    tmp: Path,
    *endpoints: str,
    args: tuple[str, ...] = (),
    wait_ready: int | None = None,
    name: str = "gateway",
    env: dict[str, str] | None = None,
) -> Proc:
    port, admin = free_port(), free_port()
    argv = [
        sys.executable,
        "-m",
        "unbroken",
        "gateway",
        "--port",
        str(port),
        "--admin-port",
        str(admin),
        "--workers",  # one process unless a test asks for more (args come later and win)
        "1",
    ]
    for e in endpoints:
        argv += ["--endpoint", e]
    argv += list(args)
    p = Proc(
        argv,
        port,
        tmp / f"{name}-{port}.log",
        env={**(env or {}), "UNBROKEN_ADMIN_TOKEN": TOKEN},
        admin_port=admin,
    ).start()
    want = len(endpoints) if wait_ready is None else wait_ready
    wait_endpoints(p, lambda eps: sum(e["state"] == "ready" for e in eps) >= want)
    return p


def admin(
    p: Proc, method: str, path: str, body: Any = None, token: str | None = TOKEN
) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.request(method, p.admin_url + path, json=body, headers=headers, timeout=10)


def wait_endpoints(p: Proc, cond: Any, timeout: float = 20.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        eps = admin(p, "GET", "/admin/endpoints").json()["endpoints"]
        if cond(eps):
            return eps
        if time.monotonic() > deadline:
            raise AssertionError(f"endpoints never reached the condition: {eps}")
        time.sleep(0.05)


def wait_for(
    cond: Any, timeout: float = 10.0, interval: float = 0.02, what: str | Callable[[], str] = ""
) -> Any:
    """Poll `cond` until truthy; `what` (or what it returns, evaluated only on a timeout) is
    the failure's message."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out waiting for {(what() if callable(what) else what) or cond}"
            )
        time.sleep(interval)


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of a metric's samples whose labels include `labels`."""
    text = httpx.get(url + "/metrics", timeout=5).text
    total = 0.0
    found = False
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        base = head.split("{", 1)[0]
        if base != name:
            continue
        if labels:
            lab = head[len(base) :]
            if not all(f'{k}="{v}"' in lab for k, v in labels.items()):
                continue
        total += float(value)
        found = True
    if not found:
        raise KeyError(f"{name}{labels} not in /metrics")
    return total


def stream(
    url: str,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
    timeout: float = 60.0,
    on_open: Callable[[httpx.Response], None] | None = None,
) -> tuple[list[Any], httpx.Response]:
    """POST a streaming request; return the decoded events ('[DONE]' kept as a string).
    `on_open`: called with the response once its headers are in (a 200), before any event."""
    events: list[Any] = []
    dec = SSEDecoder()
    with httpx.stream(
        "POST", url + path, json={**body, "stream": True}, headers=headers, timeout=timeout
    ) as r:
        if r.status_code != 200:
            r.read()
            return [], r
        if on_open is not None:
            on_open(r)
        for chunk in r.iter_raw():
            for ev in dec.feed(chunk):
                if ev.data is None:
                    continue
                events.append("[DONE]" if ev.is_done else orjson.loads(ev.data))
    return events, r


def stream_text(events: list[Any], chat: bool) -> str:
    out = []
    for ev in events:
        if not isinstance(ev, dict):
            continue
        for ch in ev.get("choices", []):
            out.append((ch.get("delta") or {}).get("content") or "" if chat else ch.get("text", ""))
    return "".join(out)


UPS: list[Up] = []  # every `unbroken up` a test started: conftest kills what is left


def proc_start_time(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat (clock ticks after boot): with the pid, who a process is."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def kill_plane(state: Path) -> list[int]:
    """SIGKILL the process group of each process recorded in STATE/plane.json that is still
    the process recorded (same start time: a reused pid is left alone)."""
    try:
        plane = json.loads((state / "plane.json").read_text())
    except (OSError, ValueError):
        return []
    procs = [plane.get("gateway") or {}, *plane.get("replicas", []), *plane.get("companions", [])]
    killed = []
    for p in procs:
        pid = p.get("pid")
        if pid and proc_start_time(pid) == p.get("start"):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)  # each runs in its own session: pgid == pid
                killed.append(pid)
    return killed


class Up:
    def __init__(
        self,
        tmp: Path,
        spec: Path | None = None,
        env: dict[str, str] | None = None,
        agent: bool = False,
    ) -> None:
        """`agent`: start the eBPF agent too (as root); off by default, since one agent per
        pipeline test would attach to every engine on the machine."""
        self.state = tmp / "state"
        self.port, self.admin_port = free_port(), free_port()
        self.controller_port, self.agent_port = free_port(), free_port()
        self.env = {**os.environ, "UNBROKEN_STATE_DIR": str(self.state), **(env or {})}
        self.env.pop("UNBROKEN_ADMIN_TOKEN", None) if env is None else None
        argv = [
            sys.executable,
            "-m",
            "unbroken",
            "up",
            "--port",
            str(self.port),
            "--admin-port",
            str(self.admin_port),
            "--controller-port",
            str(self.controller_port),
            "--agent-port",
            str(self.agent_port),
            *([] if agent else ["--no-agent"]),
        ]
        if spec is not None:
            argv.append(str(spec))
        self.argv = argv
        self.log = tmp / "up.log"
        UPS.append(self)
        self.launch()

    def launch(self) -> None:
        """Start `unbroken up` (again: same ports, same state directory) and wait until its
        supervisor has written run.json (one left by a supervisor that died does not count)."""
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )

        def up() -> bool:
            if self.proc.poll() is not None:
                return True
            with contextlib.suppress(OSError, ValueError):
                run = json.loads((self.state / "run.json").read_text())
                return bool(run.get("pid") == self.proc.pid)
            return False

        wait_for(up, timeout=90, what="pipeline up")
        assert self.proc.poll() is None, self.log.read_text()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def status(self) -> dict[str, Any]:
        out = subprocess.run(
            [sys.executable, "-m", "unbroken", "status", "--json"],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        return json.loads(out)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        finally:
            self.kill_orphans()

    def kill_orphans(self) -> list[int]:
        """SIGKILL the supervisor if it still runs, and every process group of the data plane
        it recorded (STATE/plane.json; a clean stop removes it). A supervisor that dies no
        longer takes its engines and gateway with it, so a test that SIGKILLs one, or fails
        before its clean stop, would leak processes that hold ports and CPU. The pids killed."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        return kill_plane(self.state)

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "unbroken", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )


def small_up(tmp: Path) -> Up:
    """`unbroken up` of one pool of two fast simulated replicas (the CLI and bench tests)."""
    spec = tmp / "spec.yaml"
    spec.write_text(
        f"model: {MODEL}\npools:\n  - name: primary\n    replicas: 2\n"
        "    weights_size: 8MiB\n    engine: {overrides: {decode_base_s: 0.005}}\n"
    )
    return Up(tmp, spec)


class Poller:
    """Calls `poll()` every `period` seconds in a thread, from `__enter__` to `__exit__`."""

    period = 0.01

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def poll(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll()
            time.sleep(self.period)

    def __enter__(self) -> Any:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()


def ready_endpoint(name: str, pool: str = "default", inflight: int = 0) -> Endpoint:
    """An in-process endpoint serving model "m", ready, with `inflight` slots taken: for the
    routing policies' arithmetic."""
    e = Endpoint(name=name, url=f"http://{name}", pool=pool)
    e.models = {"m"}
    e.set_state(State.READY)
    e.slot.add(inflight)
    return e
