"""The supervisor's hold on its state directory: one pipeline per directory.

The lock is an flock on STATE/lock (config/paths.py), held from `unbroken up`'s start to its
stop; the kernel drops it however the supervisor dies. What is in the directory (run.json,
plane.json) is the supervisor's to write or remove only while it holds the lock.
"""

from __future__ import annotations

import os
from pathlib import Path

from unbroken.config.paths import StateDirBusy, lock_state_dir
from unbroken.pipeline.procs import StartupError

__all__ = ["StateLock"]


class StateLock:
    def __init__(self, state: Path) -> None:
        self.state = state
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def take(self) -> None:
        """Take the state directory (StartupError if another pipeline has it); idempotent."""
        if self._fd is None:
            try:
                self._fd = lock_state_dir(self.state)
            except StateDirBusy as e:
                raise StartupError(str(e)) from None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
