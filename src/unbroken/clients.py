"""Boundary clients for unbroken's own admin APIs. Each call is keyword-only and maps HTTP
failures to one exception tree:

    AdminError
    ├── AdminUnreachable   connection refused, timeout
    └── AdminRejected      the API answered 4xx/5xx (status and OpenAI-style message kept)

and the one client of `unbroken up`'s supervisor control socket (`SupervisorClient`: the CLI,
the benchmarks, the controller's dynamic precision and autoscaler), whose failures are

    SupervisorError
    ├── SupervisorUnreachable   a sentence a person can act on
    └── SupervisorRejected      the supervisor refused (status, message)
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any, Self

import aiohttp
import orjson

__all__ = [
    "AdminError",
    "AdminRejected",
    "AdminUnreachable",
    "EngineAdmin",
    "GatewayAdmin",
    "SupervisorClient",
    "SupervisorError",
    "SupervisorRejected",
    "SupervisorUnreachable",
]


class AdminError(Exception):
    pass


class AdminUnreachable(AdminError):
    pass


class AdminRejected(AdminError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


class _AdminClient:
    """Bearer-authenticated JSON calls with the exception tree above."""

    def __init__(self, base_url: str, token: str, *, timeout: float = 10.0) -> None:
        self.base = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"}
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _call(self, method: str, path: str, body: Any = None) -> Any:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        data = orjson.dumps(body) if body is not None else None
        try:
            async with self._session.request(
                method, self.base + path, data=data, headers=self._headers
            ) as r:
                raw = await r.read()
                if r.status >= 400:
                    try:
                        msg = orjson.loads(raw)["error"]["message"]
                    except (orjson.JSONDecodeError, KeyError, TypeError):
                        msg = raw.decode(errors="replace")[:200]
                    raise AdminRejected(r.status, msg)
                try:
                    return orjson.loads(raw) if raw else None
                except orjson.JSONDecodeError:
                    # Something answered, but not this API (a wrong port, another service).
                    snippet = raw.decode(errors="replace")[:80]
                    raise AdminRejected(
                        r.status, f"not a JSON answer from {self.base + path}: {snippet!r}"
                    ) from None
        except (aiohttp.InvalidURL, aiohttp.NonHttpUrlClientError) as e:
            why = f"not an http(s) URL ({type(e).__name__}: {e}): expected http(s)://HOST:PORT"
            raise AdminUnreachable(f"{self.base}: {why}") from None
        except (aiohttp.ClientConnectionError, TimeoutError) as e:
            raise AdminUnreachable(f"{self.base}: {type(e).__name__}: {e}") from None


class GatewayAdmin(_AdminClient):
    """Client of a gateway's admin API."""

    async def endpoints(self) -> list[dict[str, Any]]:
        return (await self._call("GET", "/admin/endpoints"))["endpoints"]

    async def status(self) -> dict[str, Any]:
        return await self._call("GET", "/admin/status")

    async def add(
        self,
        *,
        url: str,
        name: str,
        pool: str = "default",
        cap: int | None = None,
        warmup: bool = True,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"url": url, "name": name, "pool": pool, "warmup": warmup}
        if cap is not None:
            body["cap"] = cap
        return await self._call("POST", "/admin/endpoints", body)

    async def remove(self, *, name: str) -> dict[str, Any]:
        return await self._call("DELETE", f"/admin/endpoints/{name}")

    async def drain(self, *, name: str, deadline_s: float | None = None) -> dict[str, Any]:
        body = {} if deadline_s is None else {"deadline_s": deadline_s}
        return await self._call("POST", f"/admin/endpoints/{name}/drain", body)

    async def set_cap(self, *, name: str, cap: int | None) -> dict[str, Any]:
        return await self._call("PATCH", f"/admin/endpoints/{name}", {"cap": cap})

    async def routes(self) -> dict[str, Any]:
        return await self._call("GET", "/admin/routes")

    async def set_routes(self, *, routes: dict[str, list[str]]) -> dict[str, Any]:
        return await self._call("PUT", "/admin/routes", {"routes": routes})

    async def patch(self, *, name: str, **fields: Any) -> dict[str, Any]:
        """Set any of `cap`, `pool`, `cap_override` (None clears it), `condition`."""
        return await self._call("PATCH", f"/admin/endpoints/{name}", fields)

    async def rebalance(
        self,
        *,
        name: str,
        priorities: list[str],
        batch: int | None = None,
        every_s: float | None = None,
    ) -> dict[str, Any]:
        """Move the endpoint's running streams of these priorities elsewhere: all now, or
        `batch` every `every_s` seconds."""
        body: dict[str, Any] = {"priorities": priorities}
        if batch is not None:
            body["batch"] = batch
        if every_s is not None:
            body["every_s"] = every_s
        return await self._call("POST", f"/admin/endpoints/{name}/rebalance", body)

    async def set_routes_override(self, *, routes: dict[str, list[str]]) -> dict[str, Any]:
        return await self._call("PUT", "/admin/routes/override", {"routes": routes})

    async def clear_routes_override(self) -> dict[str, Any]:
        return await self._call("DELETE", "/admin/routes/override")


class EngineAdmin(_AdminClient):
    """Client of the engine simulator's admin API (faults, runtime config, state). vLLM has
    no such API: against a real engine these calls fail with AdminRejected (404)."""

    async def faults(self) -> dict[str, Any]:
        return await self._call("GET", "/admin/faults")

    async def inject(self, *, kind: str, **params: Any) -> dict[str, Any]:
        """e.g. inject(kind="slow_cuda", extra_ms=15, onset_s=2, duration_s=10)."""
        return await self._call("POST", "/admin/faults", {"kind": kind, **params})

    async def clear(self) -> dict[str, Any]:
        return await self._call("DELETE", "/admin/faults")

    async def config(self) -> dict[str, Any]:
        return await self._call("GET", "/admin/config")

    async def set_max_num_seqs(self, *, max_num_seqs: int) -> dict[str, Any]:
        return await self._call("POST", "/admin/config", {"max_num_seqs": max_num_seqs})

    async def state(self) -> dict[str, Any]:
        return await self._call("GET", "/admin/state")


# -- the supervisor's control socket ----------------------------------------------------
_BASE = "http://supervisor"


class SupervisorError(Exception):
    pass


class SupervisorUnreachable(SupervisorError):
    def __init__(self, message: str, *, refused: bool = False) -> None:
        super().__init__(message)
        # Nothing listens on the socket (refused, or no socket file): the supervisor is not
        # running, whatever run.json says (it outlives a SIGKILL).
        self.refused = refused


def _refused(e: BaseException) -> bool:
    os_error = getattr(e, "os_error", None)
    return isinstance(e, FileNotFoundError | ConnectionRefusedError) or isinstance(
        os_error, FileNotFoundError | ConnectionRefusedError
    )


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

    async def _call(
        self,
        method: str,
        path: str,
        *,
        read_timeout: float = 30,
        json_body: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        try:
            async with (
                self._session(read_timeout) as s,
                s.request(method, _BASE + path, json=json_body) as r,
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
                    err = data.get("error", data) if isinstance(data, dict) else data
                    msg = err.get("message", err) if isinstance(err, dict) else err
                    raise SupervisorRejected(r.status, str(msg))
                return data
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as e:
            raise SupervisorUnreachable(
                f"cannot reach the supervisor at {self.socket}: {type(e).__name__}: {e}",
                refused=_refused(e),
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
                f"cannot reach the supervisor at {self.socket}: {type(e).__name__}: {e}",
                refused=_refused(e),
            ) from None
        return summary

    async def pools(self) -> dict[str, Any]:
        """The pools as the autoscaler reads them every interval (cheap: no gateway call):
        `busy`, `scaling`, and per pool `declared`, `live`, `autoscale`, `scaling`, `model`."""
        return await self._call("GET", "/pools", read_timeout=5)

    async def scale(
        self, pool: str, replicas: int, reason: str = "", *, read_timeout: float = 600
    ) -> dict[str, Any]:
        """Resize an autoscaled pool; answers when done (`ok`, `added`, `removed`,
        `limited`, `seconds`). SupervisorRejected: out of range, unknown pool, or busy (409)."""
        body = {"pool": pool, "replicas": replicas, "reason": reason}
        return await self._call("POST", "/scale", json_body=body, read_timeout=read_timeout)

    async def drain(
        self, replica: str, deadline_s: float | None = None, *, timeout_s: float = 600.0
    ) -> dict[str, Any]:
        """Drain one of the pipeline's replicas and replace it; answers when it has
        stopped and its successor serves (`replica`, `drain_s`, `replaced_by`, ...).
        SupervisorRejected 404: not one of the supervisor's replicas; 409: busy."""
        body: dict[str, Any] = {"replica": replica, "timeout_s": timeout_s}
        if deadline_s is not None:
            body["deadline_s"] = deadline_s
        return await self._call("POST", "/drain", json_body=body, read_timeout=timeout_s + 180)

    async def convert(
        self, endpoint: str, to_pool: str, *, read_timeout: float = 300
    ) -> dict[str, Any]:
        """Move one replica to another pool (dynamic precision); answers when done."""
        body = {"endpoint": endpoint, "to_pool": to_pool}
        return await self._call("POST", "/convert", json_body=body, read_timeout=read_timeout)
