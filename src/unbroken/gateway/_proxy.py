"""The OpenAI-compatible routes of the gateway: validate, admit, pick, forward, relay."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
from aiohttp import web

from unbroken.gateway._admission import PRIORITIES, Admission
from unbroken.gateway._pool import Endpoint, Pool, State
from unbroken.gateway._relay import ClientSink
from unbroken.gateway._stream import UPSTREAM_ERRORS, Retry, StreamRelay
from unbroken.wire.errors import ApiError
from unbroken.wire.openai import ChatRequest, CompletionRequest, parse_request

if TYPE_CHECKING:
    from unbroken.gateway._metrics import GatewayMetrics
    from unbroken.gateway._server import GatewayConfig

__all__ = ["Proxy"]

log = logging.getLogger("unbroken.gateway")

_HOP = {
    "host",
    "content-length",
    "connection",
    "keep-alive",
    "transfer-encoding",
    "te",
    "upgrade",
    "proxy-authorization",
    "proxy-connection",
    "accept-encoding",
    "trailer",
}


class Proxy:
    def __init__(
        self,
        cfg: GatewayConfig,
        pool: Pool,
        admission: Admission,
        metrics: GatewayMetrics,
        on_release: object,
    ) -> None:
        self.cfg = cfg
        self.pool = pool
        self.admission = admission
        self.metrics: GatewayMetrics = metrics  # type: ignore[assignment]
        self._on_release = on_release
        self.session: aiohttp.ClientSession | None = None
        self.sinks: set[ClientSink] = set()  # live streams, for the buffered-bytes gauge
        self._skip = _HOP | {cfg.priority_header.lower()}

    # -- routes -------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "/v1/completions", chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "/v1/chat/completions", chat=True)

    async def models(self, request: web.Request) -> web.Response:
        now = int(time.time())
        data = [
            {"id": m, "object": "model", "created": now, "owned_by": "unbroken"}
            for m in sorted(self.pool.known_models())
        ]
        return web.Response(
            body=orjson.dumps({"object": "list", "data": data}), content_type="application/json"
        )

    # -- the request path ---------------------------------------------------------------------
    def _priority(self, request: web.Request) -> str:
        value = request.headers.get(self.cfg.priority_header)
        if value is None and self.cfg.priority_keys:
            auth = request.headers.get("Authorization", "")
            if auth.startswith("Bearer "):
                value = self.cfg.priority_keys.get(auth[7:])
        if value is None:
            return self.cfg.default_priority
        value = value.strip().lower()
        if value not in PRIORITIES:
            raise ApiError(
                400,
                f"{self.cfg.priority_header} must be one of {', '.join(PRIORITIES)}, got {value!r}",
                param=self.cfg.priority_header,
                code="invalid_priority",
            )
        return value

    async def _handle(self, request: web.Request, path: str, *, chat: bool) -> web.StreamResponse:
        t0 = time.monotonic()
        priority = self.cfg.default_priority
        pool_label = "none"
        status = 500
        try:
            priority = self._priority(request)
            body = await request.read()
            req, raw = parse_request(ChatRequest if chat else CompletionRequest, body)
            if not self.pool.serves(req.model):
                if (
                    any(
                        e.state in (State.STARTING, State.WARMING) and not e.models
                        for e in self.pool.endpoints.values()
                    )
                    or not self.pool.endpoints
                ):
                    raise ApiError(
                        503,
                        "no endpoint is ready yet",
                        code="no_endpoint",
                        headers={"Retry-After": "1"},
                    )
                raise ApiError(
                    404,
                    f"The model `{req.model}` does not exist.",
                    param="model",
                    code="model_not_found",
                )
            resp, pool_label = await self._forward(
                request, path, req, raw, body, priority, t0, chat
            )
            status = resp.status
            return resp
        except ApiError as e:
            status = e.status
            if e.status == 429:
                self.metrics.shed.labels(priority, e.code or "shed").inc()
            raise
        except asyncio.CancelledError:
            status = 499  # client closed the request (nginx's convention)
            raise
        finally:
            self.metrics.requests.labels(str(status), priority, pool_label).inc()

    def _headers(self, request: web.Request) -> dict[str, str]:
        h = {k: v for k, v in request.headers.items() if k.lower() not in self._skip}
        h.setdefault("X-Request-Id", uuid.uuid4().hex)
        return h

    async def _forward(
        self,
        request: web.Request,
        path: str,
        req: CompletionRequest | ChatRequest,
        raw: dict[str, Any],
        body: bytes,
        priority: str,
        t0: float,
        chat: bool,
    ) -> tuple[web.StreamResponse, str]:
        assert self.session is not None
        headers = self._headers(request)
        tried: list[Endpoint] = []
        last: tuple[int, bytes] | None = None
        for attempt in range(self.cfg.max_attempts):
            if attempt and not self.pool.could_serve(req.model, priority, tried):
                break
            ep, waited = await self.admission.acquire(req.model, priority, tried)
            if waited:
                self.metrics.queue_wait.labels(priority).observe(waited)
            handed = False  # the stream relay releases its own slots
            try:
                try:
                    up = await self.session.post(ep.url + path, data=body, headers=headers)
                except UPSTREAM_ERRORS as e:
                    raise Retry("connect", f"{type(e).__name__}: {e}") from None
                if up.status >= 500:
                    last = (up.status, await _read_quietly(up))
                    raise Retry(f"status_{up.status}", f"HTTP {up.status}")
                if up.status >= 400 or not req.stream:
                    try:
                        data = await up.read()
                    except UPSTREAM_ERRORS as e:
                        raise Retry("reset", f"{type(e).__name__}: {e}") from None
                    finally:
                        up.release()
                    out = web.Response(
                        status=up.status,
                        body=data,
                        content_type=up.content_type or "application/json",
                        headers={"X-Unbroken-Endpoint": ep.name},
                    )
                    return out, ep.pool
                handed = True
                relay = StreamRelay(
                    self,
                    request,
                    path=path,
                    raw=raw,
                    chat=chat,
                    model=req.model,
                    priority=priority,
                    headers=headers,
                    t0=t0,
                )
                return await relay.run(up, ep), ep.pool
            except Retry as r:
                if not handed:  # a relay has already recorded its own failure
                    self.upstream_failed(ep, r.kind, str(r))
                tried.append(ep)
                self.metrics.retries.labels(r.kind).inc()
            finally:
                if not handed:
                    self.release(ep)
        if last is not None and _is_openai_error(last[1]):
            return web.Response(
                status=last[0], body=last[1], content_type="application/json"
            ), "none"
        raise ApiError(
            502,
            f"no endpoint could serve the request after {len(tried)} attempt(s)",
            code="upstream_unavailable",
        )

    def release(self, ep: Endpoint) -> None:
        self.admission.release(ep)
        self._on_release(ep)  # type: ignore[operator]

    def upstream_failed(self, ep: Endpoint, kind: str, detail: str) -> None:
        self.metrics.upstream_errors.labels(ep.name, kind).inc()
        ep.last_error = f"{kind}: {detail}"
        if kind in ("connect", "reset"):
            # Out of rotation until its next health check passes.
            ep.healthy = False
        log.warning("upstream %s failed (%s): %s", ep.name, kind, detail)


async def _read_quietly(up: aiohttp.ClientResponse) -> bytes:
    try:
        return await up.read()
    except UPSTREAM_ERRORS:
        return b""
    finally:
        up.release()


def _is_openai_error(body: bytes) -> bool:
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    return isinstance(obj, dict) and isinstance(obj.get("error"), dict)
