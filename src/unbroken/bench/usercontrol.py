"""Scenarios on a user's own engines (no `unbroken up`): the disruption is a shell command
the user gives (`--scenario-command`), e.g. `kill -TERM 4242`, `systemctl restart vllm@1` or
`kubectl rollout restart deploy/vllm`. Same calls as `PipelineControl`, so the runner does
not care which it has."""

from __future__ import annotations

import asyncio
import time
from typing import Any

__all__ = ["CommandControl"]


class CommandControl:
    def __init__(self, command: str, timeout_s: float = 600.0) -> None:
        self.command = command
        self.timeout_s = timeout_s
        self.last: dict[str, Any] = {}

    async def _run(self) -> dict[str, Any]:
        t0 = time.monotonic()
        proc = await asyncio.create_subprocess_shell(
            self.command,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), self.timeout_s)
        except TimeoutError:
            proc.kill()
            out, _ = await proc.communicate()
        rc = proc.returncode
        self.last = {
            "ok": rc == 0,
            "rc": rc,
            "seconds": round(time.monotonic() - t0, 3),
            "output": out.decode(errors="replace")[-2000:],
        }
        if rc != 0:
            self.last["error"] = f"`{self.command}` exited {rc}"
        return self.last

    async def status(self) -> dict[str, Any]:
        return {"replicas": [], "command": self.command, "last": self.last}

    async def rollout(self, pool: str, engine: dict[str, Any], *, deadline_s: float) -> dict:
        """Run the command and wait for it: it is the user's rollout."""
        return await self._run()

    async def kill(self, pool: str) -> dict[str, Any]:
        """Run the command: it is the user's fault injection."""
        r = await self._run()
        return {"name": self.command, "pid": None, **r}

    async def wait_replaced(self, name: str, timeout: float = 60) -> str | None:
        return None  # what replaces the engine is the user's own business
