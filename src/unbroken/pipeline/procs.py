"""Child-process mechanics of the local supervisor, for every part that runs a process.

A child gets its own session and its log in STATE/logs (`spawn`); a process an earlier
supervisor started is held as `Adopted` (a pidfd, so a reused pid is never signalled);
`terminate` is the one graceful-then-forced stop; `backoff` spaces the retries of whatever
is restarted (replicas, the gateway). Nothing here knows what the processes are.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import select
import signal
import time
from pathlib import Path
from typing import Any

__all__ = [
    "BACKOFF_FIRST_S",
    "BACKOFF_MAX_S",
    "UNKNOWN_EXIT",
    "Adopted",
    "Proc",
    "StartupError",
    "backoff",
    "die_with_parent",
    "first_line",
    "proc_record",
    "proc_start_time",
    "spawn",
    "tail",
    "terminate",
]


log = logging.getLogger("unbroken.pipeline")


class StartupError(RuntimeError):
    """A part of the pipeline could not be started (its message says why, with its log)."""


# Retry delays for replacing a replica or restarting the gateway: doubling, capped.
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 60.0
UNKNOWN_EXIT = -1  # an adopted process is not our child: its exit status cannot be read


def backoff(attempt: int) -> float:
    return float(min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** max(0, attempt - 1)))


def first_line(e: BaseException) -> str:
    """Why a start failed, in one line (a StartupError goes on with its log's tail)."""
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def proc_start_time(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat (clock ticks after boot): with the pid, who a process is."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


class Adopted:
    """A process an earlier supervisor started (not our child), with the part of
    asyncio.subprocess.Process the supervisor uses. A pidfd pins it: signals go to this
    process or nowhere, and `wait` wakes when it exits (its exit status is UNKNOWN_EXIT)."""

    def __init__(self, pid: int, pidfd: int) -> None:
        self.pid = pid
        self._fd = pidfd
        self._code: int | None = None

    @classmethod
    def verify(cls, rec: dict[str, Any]) -> Adopted | None:
        """The recorded process if it still runs (the same pid and start time, which together
        name one process: a pid reused since has a later start), else None. Not its argv: a
        command engine started through a script that `exec`s, or a shebang script (vLLM's
        `vllm` is one), runs with another command line than the one recorded, and was left
        running, unadopted, past `unbroken down` (a review as an SRE)."""
        pid = rec.get("pid")
        if not isinstance(pid, int) or pid <= 0:
            return None
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return None
        # Checked after the pidfd is open: if the pid was reused before, this sees it.
        start = rec.get("start")
        if start is None or proc_start_time(pid) != start:
            os.close(fd)
            return None
        return cls(pid, fd)

    def release(self) -> None:
        """Let go of a process only looked at (its pidfd closed; the process runs on)."""
        if self._code is None:
            os.close(self._fd)
            self._code = UNKNOWN_EXIT

    @property
    def returncode(self) -> int | None:
        if self._code is None and select.select([self._fd], [], [], 0)[0]:
            self._exited()
        return self._code

    def _exited(self) -> None:
        if self._code is None:
            self._code = UNKNOWN_EXIT
            os.close(self._fd)

    async def wait(self) -> int:
        while self.returncode is None:
            loop = asyncio.get_running_loop()
            ready = loop.create_future()
            loop.add_reader(self._fd, ready.set_result, None)
            try:
                await ready
            finally:
                loop.remove_reader(self._fd)
        assert self._code is not None
        return self._code

    def send_signal(self, sig: int) -> None:
        if self.returncode is not None:
            raise ProcessLookupError(self.pid)
        signal.pidfd_send_signal(self._fd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


Proc = asyncio.subprocess.Process | Adopted


def proc_record(proc: Proc, argv: list[str]) -> dict[str, Any]:
    """Who a process is, as plane.json records it (what `Adopted.verify` checks)."""
    return {"pid": proc.pid, "start": proc_start_time(proc.pid), "argv": argv}


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGTERM if the supervisor dies, even by SIGKILL."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


async def spawn(
    logs: Path, name: str, argv: list[str], env: dict[str, str] | None, *, survive: bool
) -> tuple[asyncio.subprocess.Process, Path]:
    """Start `argv` in its own session, output appended to LOGS/NAME.log (0600). `survive`:
    no parent-death signal (the process outlives the supervisor). StartupError if the
    program cannot be run at all."""
    logs.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = logs / f"{name}.log"
    out = os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab")
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdout=out,
            stderr=asyncio.subprocess.STDOUT,
            stdin=asyncio.subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            start_new_session=True,
            preexec_fn=None if survive else die_with_parent,
        )
    except (FileNotFoundError, PermissionError) as e:
        raise StartupError(f"cannot start {name}: {argv[0]}: {e.strerror}") from None
    finally:
        out.close()
    return proc, path


async def terminate(proc: Proc, timeout: float, name: str | None = None) -> int:
    """SIGTERM (the process finishes what it holds), SIGKILL after `timeout`; its exit code.
    With a `name`, the kill is logged (a SIGKILL cuts whatever the process still held)."""
    t0 = time.monotonic()
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        return await asyncio.wait_for(proc.wait(), timeout)
    except TimeoutError:
        if name is not None:
            log.warning(
                "%s (pid %s) did not exit %.1f s after SIGTERM: killed",
                name,
                proc.pid,
                time.monotonic() - t0,
            )
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        return await proc.wait()


def log_size(path: Path | None) -> int:
    """Where a log (appended to across starts) ends now: what a new start writes comes after."""
    try:
        return path.stat().st_size if path is not None else 0
    except OSError:
        return 0


def tail(path: Path | None, lines: int = 15, since: int = 0) -> str:
    """The end of a log, for an error message: of what was written after byte `since` (this
    start's lines; a log appended to across starts held an earlier start's errors, which a
    review saw repeated as this one's)."""
    if path is None:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(since)
            text = f.read().decode(errors="replace")
        return "\n".join(text.splitlines()[-lines:])
    except OSError:
        return ""
