"""Where a local pipeline keeps its state: run info, the admin tokens, logs, the control
socket, the lock. `UNBROKEN_STATE_DIR` overrides the default (XDG state home).

The directory is private (0700) and its secrets 0600. Two tokens live there: the gateway's
admin token (`admin-token`) and the engines' own admin token (`engine-token`, what fault
injection on a local engine needs; see `engine_token_path`), so one leaked secret does not
open both. One pipeline per directory: the supervisor holds an exclusive `flock` on `lock`
for its whole life (`lock_state_dir`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = [
    "RunInfo",
    "StateDirBusy",
    "admin_token",
    "cache_dir",
    "engine_token",
    "engine_token_path",
    "ensure_state_dir",
    "lock_state_dir",
    "state_dir",
]


def state_dir() -> Path:
    env = os.environ.get("UNBROKEN_STATE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "unbroken"


def cache_dir() -> Path:
    return Path(os.environ.get("UNBROKEN_CACHE_DIR", Path.home() / ".cache" / "unbroken"))


class StateDirBusy(RuntimeError):
    """Another live pipeline holds the state directory."""


def ensure_state_dir(directory: Path) -> Path:
    """Create the directory if needed and make it private (0700)."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(directory, 0o700)
    return directory


def lock_state_dir(directory: Path) -> int:
    """An exclusive lock on `directory` for as long as the returned descriptor stays open
    (the kernel drops it when the process dies, however it dies). StateDirBusy if another
    process holds it."""
    ensure_state_dir(directory)
    path = directory / "lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = ""
        with contextlib.suppress(OSError, ValueError):
            holder = f" (pid {int(os.pread(fd, 32, 0).split()[0])})"
        os.close(fd)
        raise StateDirBusy(
            f"another pipeline{holder} is running with the state directory {directory}; "
            "stop it, or set UNBROKEN_STATE_DIR to another directory to run a second one"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _write_secret(path: Path, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    os.chmod(path, 0o600)


def admin_token(directory: Path) -> tuple[str, Path, bool]:
    """(token, file, generated). `UNBROKEN_ADMIN_TOKEN` wins; else the file's token is reused
    or a new one is generated and written readable by the user only."""
    path = directory / "admin-token"
    env = os.environ.get("UNBROKEN_ADMIN_TOKEN")
    if env:
        token, generated = env, False
    elif path.exists():
        return path.read_text().strip(), path, False
    else:
        token, generated = secrets.token_urlsafe(24), True
    ensure_state_dir(directory)
    _write_secret(path, token)
    return token, path, generated


def engine_token_path(directory: Path | None = None) -> Path:
    """Where a local pipeline keeps its engines' admin token (`unbroken fault` reads it)."""
    return (directory or state_dir()) / "engine-token"


def engine_token(directory: Path) -> str:
    """The engines' admin token: reused from the file, or generated (0600). Never the
    gateway's token."""
    path = engine_token_path(directory)
    with contextlib.suppress(OSError):
        token = path.read_text().strip()
        if token:
            return token
    token = secrets.token_urlsafe(24)
    ensure_state_dir(directory)
    _write_secret(path, token)
    return token


@dataclass
class RunInfo:
    pid: int
    gateway_url: str
    admin_url: str
    control_socket: str
    token_file: str
    started: float

    def write(self, directory: Path) -> None:
        # Atomically: the agent and `unbroken status` read it while a pipeline starts.
        tmp = directory / f".run.json.{os.getpid()}"
        tmp.write_text(json.dumps(asdict(self), indent=1))
        os.replace(tmp, directory / "run.json")

    @classmethod
    def read(cls, directory: Path) -> RunInfo | None:
        try:
            data = json.loads((directory / "run.json").read_text())
            info = cls(**data)
        except (OSError, ValueError, TypeError):
            return None
        try:
            os.kill(info.pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        if _dead(info.pid):
            return None
        return info


def _dead(pid: int) -> bool:
    """Whether `pid` has exited but is not reaped yet (a zombie: `kill -0` still succeeds,
    for as long as its parent has not waited for it, and its control socket refuses)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False  # no /proc: kill -0 is all there is
    return stat.rsplit(")", 1)[-1].split()[:1] in (["Z"], ["X"])


def read_admin_token(directory: Path, info: RunInfo | None = None) -> str | None:
    """The admin token a command talking to a running pipeline uses: UNBROKEN_ADMIN_TOKEN,
    else the token file the running pipeline names (run.json), else DIR/admin-token; None
    when none of them is there. The one reader of it (drain, fault, bench)."""
    token = os.environ.get("UNBROKEN_ADMIN_TOKEN")
    if token:
        return token
    path = Path(info.token_file) if info is not None else directory / "admin-token"
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def read_engine_token(directory: Path) -> str | None:
    """The engines' admin token: UNBROKEN_ENGINE_TOKEN, else DIR/engine-token if the
    pipeline wrote one (None: there is none). OSError when the file is there but unreadable."""
    token = os.environ.get("UNBROKEN_ENGINE_TOKEN")
    if token:
        return token
    path = engine_token_path(directory)
    if not path.exists():
        return None
    return path.read_text().strip() or None
