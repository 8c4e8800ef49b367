"""Boundary clients for unbroken's own admin APIs. Each call is keyword-only and maps HTTP
failures to one exception tree:

    AdminError
    ├── AdminUnreachable   connection refused, timeout
    └── AdminRejected      the API answered 4xx/5xx (status and OpenAI-style message kept)
"""

from __future__ import annotations

from typing import Any, Self

import aiohttp
import orjson

__all__ = ["AdminError", "AdminRejected", "AdminUnreachable", "EngineAdmin", "GatewayAdmin"]


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
