"""Where a local pipeline keeps its state: run info, the admin token, logs, the control
socket. `UNBROKEN_STATE_DIR` overrides the default (XDG state home)."""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["RunInfo", "admin_token", "cache_dir", "state_dir"]


def state_dir() -> Path:
    env = os.environ.get("UNBROKEN_STATE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "unbroken"


def cache_dir() -> Path:
    return Path(os.environ.get("UNBROKEN_CACHE_DIR", Path.home() / ".cache" / "unbroken"))


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
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.chmod(path, 0o600)
    return token, path, generated


@dataclass
class RunInfo:
    pid: int
    gateway_url: str
    admin_url: str
    control_socket: str
    token_file: str
    started: float

    def write(self, directory: Path) -> None:
        (directory / "run.json").write_text(json.dumps(asdict(self), indent=1))

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
        return info
