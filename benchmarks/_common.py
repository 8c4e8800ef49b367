"""Shared pieces of the benchmark scripts: processes, load, percentiles, tables."""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from unbroken.wire.http import free_port, wait_ok

CLK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> list[str]:
    """Fields of /proc/PID/stat after the command name (field 3, the state, is [0])."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float:
    f = _stat(pid)
    return (int(f[11]) + int(f[12])) / CLK


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants alive now (a gateway's main process and its workers)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(_stat(int(d))[1])
            except (OSError, IndexError, ValueError):
                continue  # exited meanwhile
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, ()))
    return out


def tree_pss_bytes(pid: int) -> int:
    """Proportional set size of `pid` and its live descendants (/proc/PID/smaps_rollup): the
    memory of a multi-process server without counting the pages its processes share once per
    process, as summed RSS would."""
    total = 0
    for p in process_tree(pid):
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
                    break
        except (OSError, ValueError, IndexError):
            continue
    return total


def tree_cpu_seconds(pid: int) -> float:
    """utime+stime+cutime+cstime of `pid` and its live descendants: the CPU of a whole
    multi-process server (a child that exits during a pass moves into its parent's cutime, so
    a difference over the pass still counts it)."""
    total = 0.0
    for p in process_tree(pid):
        try:
            f = _stat(p)
        except OSError:
            continue
        total += int(f[11]) + int(f[12]) + int(f[13]) + int(f[14])
    return total / CLK


@dataclass
class Service:
    argv: list[str]
    port: int
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, logdir: Path, name: str, env: dict[str, str] | None = None) -> Service:
        logdir.mkdir(parents=True, exist_ok=True)
        with open(logdir / f"{name}.log", "wb") as out:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                start_new_session=True,
            )
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def engine_service(*args: str) -> Service:
    port = free_port()
    return Service([sys.executable, "-m", "unbroken", "engine", "--port", str(port), *args], port)


def gateway_service(*endpoints: str, args: tuple[str, ...] = ()) -> tuple[Service, int]:
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
        "--workers",  # one process, whose CPU cpu_seconds() reads (args come later and win)
        "1",
        *args,
    ]
    for e in endpoints:
        argv += ["--endpoint", e]
    return Service(argv, port), admin


class UpPipeline:
    """`unbroken up SPEC` in its own state directory and free ports, for a benchmark pass."""

    def __init__(self, tmp: Path, spec: str, name: str, *, agent: bool = False) -> None:
        self.state = tmp / f"state-{name}"
        self.port, self.admin_port = free_port(), free_port()
        self.ctl_port, self.agent_port = free_port(), free_port()
        path = tmp / f"{name}.yaml"
        path.write_text(spec)
        self.env = {**os.environ, "UNBROKEN_STATE_DIR": str(self.state)}
        self.env.pop("UNBROKEN_ADMIN_TOKEN", None)
        argv = [
            sys.executable, "-m", "unbroken", "up", str(path),
            "--port", str(self.port), "--admin-port", str(self.admin_port),
            "--controller-port", str(self.ctl_port), "--agent-port", str(self.agent_port),
            *([] if agent else ["--no-agent"]),
        ]  # fmt: skip
        self.log = open(tmp / f"up-{name}.log", "wb")
        self.proc = subprocess.Popen(
            argv, stdout=self.log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ctl(self) -> str:
        return f"http://127.0.0.1:{self.ctl_port}"

    async def wait(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not (self.state / "run.json").exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"pipeline did not start; see {self.log.name}")
            await asyncio.sleep(0.2)

    def stop(self, timeout: float = 90.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def router_service(exe: str, urls: list[str], policy: str) -> Service:
    """vllm-router (`exe`, from `install_peer`) in front of `urls` with `--policy policy`,
    on free ports (its Prometheus port too), not started."""
    port = free_port()
    argv = [exe, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls]
    return Service([*argv, "--policy", policy, "--prometheus-port", str(free_port())], port)


async def wait_http(url: str, timeout: float = 60.0) -> None:
    async with aiohttp.ClientSession() as s:
        await wait_ok(s, url, timeout=timeout, interval=0.1)


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in rows
    ]
    return "\n".join([line, sep, *body])


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


ROOT = Path(__file__).resolve().parents[1]


def install_peer() -> tuple[str | None, str]:
    """vllm-router's executable (scripts/bench-peer.sh installs it into its own cached venv),
    or None and why not."""
    print("vllm-router: scripts/bench-peer.sh ...", file=sys.stderr)
    try:
        p = subprocess.run(
            [str(ROOT / "scripts" / "bench-peer.sh")],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"bench-peer.sh: {e}"
    if p.returncode != 0:
        lines = [ln for ln in p.stderr.splitlines() if ln.startswith("bench-peer:")]
        return None, (lines[-1] if lines else f"bench-peer.sh exited {p.returncode}")
    return p.stdout.strip().splitlines()[-1], ""
