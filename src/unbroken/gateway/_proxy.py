"""The OpenAI-compatible routes of the gateway: validate, admit, pick, forward, relay."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import TYPE_CHECKING

import aiohttp
import orjson
from aiohttp import web

from unbroken.gateway._admission import PRIORITIES, Admission
from unbroken.gateway._pool import Endpoint, Pool, State
from unbroken.gateway._relay import ClientGone, ClientSink, SlowClient, StreamTracker
from unbroken.wire.errors import ApiError
from unbroken.wire.http import SSE_HEADERS
from unbroken.wire.openai import ChatRequest, CompletionRequest, parse_request
from unbroken.wire.sse import SSEDecoder, encode_data, encode_json

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
_UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)


class _Retry(Exception):
    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


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
            req, _ = parse_request(ChatRequest if chat else CompletionRequest, body)
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
            resp, pool_label = await self._forward(request, path, req, body, priority, t0, chat)
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
            try:
                try:
                    up = await self.session.post(ep.url + path, data=body, headers=headers)
                except _UPSTREAM_ERRORS as e:
                    raise _Retry("connect", f"{type(e).__name__}: {e}") from None
                if up.status >= 500:
                    last = (up.status, await _read_quietly(up))
                    raise _Retry(f"status_{up.status}", f"HTTP {up.status}")
                if up.status >= 400 or not req.stream:
                    try:
                        data = await up.read()
                    except _UPSTREAM_ERRORS as e:
                        raise _Retry("reset", f"{type(e).__name__}: {e}") from None
                    finally:
                        up.release()
                    out = web.Response(
                        status=up.status,
                        body=data,
                        content_type=up.content_type or "application/json",
                        headers={"X-Unbroken-Endpoint": ep.name},
                    )
                    return out, ep.pool
                return await self._relay(request, up, ep, t0, chat), ep.pool
            except _Retry as r:
                self._upstream_failed(ep, r.kind, str(r))
                tried.append(ep)
                self.metrics.retries.labels(r.kind).inc()
            finally:
                self.admission.release(ep)
                self._on_release(ep)  # type: ignore[operator]
        if last is not None and _is_openai_error(last[1]):
            return web.Response(
                status=last[0], body=last[1], content_type="application/json"
            ), "none"
        raise ApiError(
            502,
            f"no endpoint could serve the request after {len(tried)} attempt(s)",
            code="upstream_unavailable",
        )

    def _upstream_failed(self, ep: Endpoint, kind: str, detail: str) -> None:
        self.metrics.upstream_errors.labels(ep.name, kind).inc()
        ep.last_error = f"{kind}: {detail}"
        if kind in ("connect", "reset"):
            # Out of rotation until its next health check passes.
            ep.healthy = False
        log.warning("upstream %s failed (%s): %s", ep.name, kind, detail)

    async def _relay(
        self, request: web.Request, up: aiohttp.ClientResponse, ep: Endpoint, t0: float, chat: bool
    ) -> web.StreamResponse:
        """Relay an upstream SSE stream. Headers go to the client only with the first event,
        so an upstream that fails before it is retried elsewhere, invisibly."""
        dec = SSEDecoder()
        tracker = StreamTracker(chat)
        resp: web.StreamResponse | None = None
        sink: ClientSink | None = None
        m = self.metrics
        pool = ep.pool
        last_token = 0.0
        broken: str | None = None
        finished_read = False
        try:
            try:
                async for chunk in up.content.iter_any():
                    events = dec.feed(chunk)
                    if not events:
                        continue
                    tokens = tracker.observe(events)
                    if sink is None:
                        resp = web.StreamResponse(
                            headers={**SSE_HEADERS, "X-Unbroken-Endpoint": ep.name}
                        )
                        await resp.prepare(request)
                        sink = ClientSink(resp, request.transport, self.cfg.stream_buffer_bytes)
                        self.sinks.add(sink)
                    if tokens:
                        now = time.monotonic()
                        if last_token == 0.0:
                            ttft, itl = m.for_pool(pool)
                            ttft.observe(now - t0)
                        else:
                            itl.observe(now - last_token)
                        for _ in range(tokens - 1):
                            itl.observe(0.0)
                        last_token = now
                    await sink.send(b"".join(e.raw for e in events))
                finished_read = True
            except _UPSTREAM_ERRORS as e:
                broken = f"{type(e).__name__}: {e}"
            tail = dec.flush()
            if tail:
                tracker.observe(tail)
                if sink is not None:
                    await sink.send(b"".join(e.raw for e in tail))
            if sink is None:
                raise _Retry(
                    "reset" if broken else "empty", broken or "stream ended before any event"
                )
            assert resp is not None
            if not tracker.complete:
                reason = "error_event" if tracker.error else ("reset" if broken else "truncated")
                if broken:
                    self._upstream_failed(ep, "reset", broken)
                m.dropped.labels(pool, reason).inc()
                log.warning("stream from %s ended without its finish (%s)", ep.name, reason)
                if tracker.error is None:
                    await sink.send(
                        encode_json(
                            {
                                "error": {
                                    "message": f"{ep.name} ended the stream early ({reason})",
                                    "type": "upstream_error",
                                    "param": None,
                                    "code": "stream_broken",
                                }
                            }
                        )
                    )
                if not tracker.done:
                    await sink.send(encode_data(b"[DONE]"))
            await sink.finish()
        except ClientGone:
            m.client_disconnects.inc()
        except SlowClient:
            m.slow_clients.inc()
            log.warning(
                "client of a stream on %s fell %d bytes behind; cutting it",
                ep.name,
                sink.buffered if sink else 0,
            )
            if sink is not None:
                sink.abort()
        except asyncio.CancelledError:
            m.client_disconnects.inc()
            if sink is not None:
                sink.abort()
            raise
        finally:
            if sink is not None:
                self.sinks.discard(sink)
            if finished_read:
                up.release()
            else:
                up.close()  # the engine sees the disconnect and frees the slot
        return resp


async def _read_quietly(up: aiohttp.ClientResponse) -> bytes:
    try:
        return await up.read()
    except _UPSTREAM_ERRORS:
        return b""
    finally:
        up.release()


def _is_openai_error(body: bytes) -> bool:
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    return isinstance(obj, dict) and isinstance(obj.get("error"), dict)
