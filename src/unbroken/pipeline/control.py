"""The one client of the supervisor's control socket (`unbroken status`, `unbroken rollout`,
`unbroken reload`, the benchmarks). Every failure to talk to the supervisor is a
`SupervisorUnreachable` with a sentence a person can act on; a refusal by the supervisor is a
`SupervisorRejected`. The server is `control_api.py`."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

__all__ = ["SupervisorClient", "SupervisorError", "SupervisorRejected", "SupervisorUnreachable"]

_BASE = "http://supervisor"


class SupervisorError(Exception):
    pass


class SupervisorUnreachable(SupervisorError):
    pass


class SupervisorRejected(SupervisorError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"the supervisor refused (HTTP {status}): {message}")
        self.status = status
        self.message = message


class SupervisorClient:
    def __init__(self, socket_path: str) -> None:
        self.socket = socket_path

    def _session(self, read_timeout: float) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=self.socket),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=read_timeout),
        )

    async def _get(self, path: str) -> dict[str, Any]:
        return await self._call("GET", path)

    async def _call(self, method: str, path: str, *, read_timeout: float = 30) -> dict[str, Any]:
        try:
            async with (
                self._session(read_timeout) as s,
                s.request(method, _BASE + path) as r,
            ):
                text = await r.text()
                try:
                    data = json.loads(text)
                except ValueError:
                    if r.status == 200:
                        raise
                    # e.g. a supervisor started by an older version, without this route
                    raise SupervisorRejected(r.status, text.strip()[:200]) from None
                if r.status != 200:
                    raise SupervisorRejected(r.status, str(data.get("error", data)))
                return data
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as e:
            raise SupervisorUnreachable(
                f"cannot reach the supervisor at {self.socket}: {type(e).__name__}: {e}"
            ) from None

    async def status(self) -> dict[str, Any]:
        return await self._get("/status")

    async def events(self) -> list[dict[str, Any]]:
        return (await self._get("/events"))["events"]

    async def reload(self, *, read_timeout: float = 120) -> dict[str, Any]:
        """Re-read the pipeline's spec and reload its gateway; the supervisor answers once
        the gateway's new workers serve: `changed` and `not_applied` (`key`, `old`, `new`
        each), `generation`, `warnings`. SupervisorRejected (nothing changed) on a spec that
        does not validate, a reload or rollout already running, or a gateway that kept its
        old workers."""
        return await self._call("POST", "/reload", read_timeout=read_timeout)

    async def rollout(
        self,
        body: dict[str, Any],
        on_event: Callable[[dict[str, Any]], Awaitable[None] | None] | None = None,
        *,
        read_timeout: float = 600,
    ) -> dict[str, Any]:
        """Start a rollout and follow its progress; the summary (`ok`, `error`, `steps`).
        A connection lost mid-rollout is reported in the summary, not raised: the rollout
        may still be running, and the supervisor's status says how it ended."""
        summary: dict[str, Any] = {"ok": False, "error": "no summary received", "steps": []}
        try:
            async with (
                self._session(read_timeout) as s,
                s.post(_BASE + "/rollout", json=body) as r,
            ):
                if r.status != 200:
                    try:
                        msg = (await r.json(content_type=None)).get("error", r.status)
                    except ValueError:
                        msg = (await r.text())[:200]
                    raise SupervisorRejected(r.status, str(msg))
                async for line in r.content:
                    if not line.strip():
                        continue
                    ev = json.loads(line)
                    if ev.get("event") == "summary":
                        summary = ev
                    if on_event is not None:
                        res = on_event(ev)
                        if res is not None:
                            await res
        except SupervisorRejected:
            raise
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as e:
            summary = {
                "ok": False,
                "error": f"lost the supervisor's progress stream ({type(e).__name__}); "
                "see `unbroken status` for how the rollout ended",
                "steps": summary.get("steps", []),
            }
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as e:
            raise SupervisorUnreachable(
                f"cannot reach the supervisor at {self.socket}: {type(e).__name__}: {e}"
            ) from None
        return summary
