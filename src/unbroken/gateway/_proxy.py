"""The OpenAI-compatible routes of the gateway: validate, admit, pick, forward, relay.

What goes upstream is rebuilt, not copied: hop-by-hop headers, the client's credentials
(`Authorization`, `Cookie`) and `Content-Encoding` (aiohttp already decoded the body) are
dropped, `Content-Type` is always `application/json`, the pool's own API key is sent when one
is configured, and `X-Request-ID` is the client's (when it is a sane token) or a new one,
echoed to the client either way.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
from aiohttp import web

from unbroken.gateway._admission import PRIORITIES, Admission
from unbroken.gateway._pool import Endpoint, Pool, State
from unbroken.gateway._relay import BufferBudget, ClientSink
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
    # Not the client's to pass on: its credentials, an encoding aiohttp already undid, a
    # content type we set, an id we validate.
    "authorization",
    "cookie",
    "content-encoding",
    "content-type",
    "x-request-id",
}
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,128}$")
# Hang detection learns each endpoint's time to first byte from this many recent streams.
_TTFB_SAMPLES = 32
_TTFB_FACTOR = 4.0


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
        self.buffer_budget = BufferBudget(cfg.stream_buffer_budget_bytes)
        self._skip = _HOP | {cfg.priority_header.lower()}
        self._ttfb: dict[str, deque[float]] = {}
        self.on_hang: Callable[[Endpoint], None] | None = None  # the prober's `suspect`
        self.pool_keys = {
            pool: key for pool, env in cfg.upstream_key_env.items() if (key := os.environ.get(env))
        }

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
        rid = _request_id(request)
        try:
            priority = self._priority(request)
            body = await request.read()
            req, raw = parse_request(ChatRequest if chat else CompletionRequest, body)
            model, streaming = req.model, req.stream
            weight = _sequences(req, raw)
            del req, raw  # a waiter keeps its body's bytes, nothing bigger
            if weight > self.cfg.max_sequences_per_request:
                raise ApiError(
                    400,
                    f"this request asks for {weight} sequences (prompts times max(n, best_of)); "
                    f"the limit is {self.cfg.max_sequences_per_request}",
                    param="n",
                    code="too_many_sequences",
                )
            if not self.pool.serves(model):
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
                    f"The model `{model}` does not exist.",
                    param="model",
                    code="model_not_found",
                )
            resp, pool_label = await self._forward(
                request, path, model, streaming, weight, body, priority, t0, chat, rid
            )
            status = resp.status
            return resp
        except ApiError as e:
            status = e.status
            e.headers.setdefault("X-Request-ID", rid)
            if e.status == 429:
                self.metrics.shed.labels(priority, e.code or "shed").inc()
            raise
        except asyncio.CancelledError:
            status = 499  # client closed the request (nginx's convention)
            raise
        finally:
            self.metrics.requests.labels(str(status), priority, pool_label).inc()

    def _headers(self, request: web.Request, rid: str) -> dict[str, str]:
        h = {k: v for k, v in request.headers.items() if k.lower() not in self._skip}
        h["Content-Type"] = "application/json"
        h["X-Request-ID"] = rid
        return h

    def upstream_headers(self, base: dict[str, str], ep: Endpoint) -> dict[str, str]:
        """`base` plus the credential of `ep`'s pool, if it has one."""
        key = self.pool_keys.get(ep.pool)
        return {**base, "Authorization": f"Bearer {key}"} if key else base

    def response_headers(self, base: dict[str, str], ep: Endpoint | None) -> dict[str, str]:
        h = {"X-Request-ID": base["X-Request-ID"]}
        if self.cfg.endpoint_header and ep is not None:
            h["X-Unbroken-Endpoint"] = ep.name
        return h

    # -- hang detection -----------------------------------------------------------------------
    def ttfb_limit(self, ep: Endpoint) -> float:
        """How long `ep` may take to send a stream's first event: a multiple of the slowest
        of its recent first events, within [ttfb_min_s, ttfb_timeout_s]; the ceiling until
        it has served a few."""
        cfg = self.cfg
        seen = self._ttfb.get(ep.name)
        if not seen or len(seen) < 4:
            return cfg.ttfb_timeout_s
        return min(cfg.ttfb_timeout_s, max(cfg.ttfb_min_s, _TTFB_FACTOR * max(seen)))

    def observe_ttfb(self, ep: Endpoint, seconds: float) -> None:
        q = self._ttfb.get(ep.name)
        if q is None:
            q = self._ttfb[ep.name] = deque(maxlen=_TTFB_SAMPLES)
        q.append(seconds)

    async def _forward(
        self,
        request: web.Request,
        path: str,
        model: str,
        streaming: bool,
        weight: int,
        body: bytes,
        priority: str,
        t0: float,
        chat: bool,
        rid: str,
    ) -> tuple[web.StreamResponse, str]:
        assert self.session is not None
        headers = self._headers(request, rid)
        tried: list[Endpoint] = []
        last: tuple[int, bytes] | None = None
        deadline = t0 + self.cfg.request_timeout_s  # non-streaming requests, all attempts
        for attempt in range(self.cfg.max_attempts):
            if attempt and not self.pool.could_serve(model, priority, tried):
                break
            ep, n, waited = await self.admission.acquire(
                model, priority, tried, weight=weight, size=len(body)
            )
            if waited:
                self.metrics.queue_wait.labels(priority).observe(waited)
            handed = False  # the stream relay releases its own slots
            try:
                limit = self.ttfb_limit(ep) if streaming else deadline - time.monotonic()
                tmo = asyncio.timeout(max(limit, 0.0))
                try:
                    async with tmo:
                        up = await self.session.post(
                            ep.url + path, data=body, headers=self.upstream_headers(headers, ep)
                        )
                        if not streaming or up.status != 200:
                            data = await _read(up)
                except UPSTREAM_ERRORS as e:
                    if not tmo.expired():
                        raise Retry("connect", f"{type(e).__name__}: {e}") from None
                    if streaming:
                        raise Retry("ttfb", f"no response within {limit:.1f} s") from None
                    self.upstream_failed(ep, "timeout", f"no response within {limit:.1f} s")
                    raise ApiError(
                        504,
                        f"the engine did not answer within {self.cfg.request_timeout_s:g} s",
                        code="upstream_timeout",
                    ) from None
                if up.status >= 500:
                    same = last is not None and (up.status, data) == last
                    last = (up.status, data)
                    if same:
                        # A second endpoint fails the same way on the same body: the body is
                        # the cause. Not this endpoint's fault, and no third try.
                        log.info("upstream %s: HTTP %d again for this body", ep.name, up.status)
                        break
                    raise Retry(f"status_{up.status}", f"HTTP {up.status}")
                if up.status >= 400 or not streaming:
                    # A 4xx is the request's fault: passed on as is, never retried elsewhere.
                    out = web.Response(
                        status=up.status,
                        body=data,
                        content_type=up.content_type or "application/json",
                        headers=self.response_headers(headers, ep),
                    )
                    return out, ep.pool
                handed = True
                relay = StreamRelay(
                    self,
                    request,
                    path=path,
                    body=body,
                    chat=chat,
                    model=model,
                    priority=priority,
                    headers=headers,
                    t0=t0,
                    weight=weight,
                )
                return await relay.run(up, ep, n), ep.pool
            except Retry as r:
                if not handed:  # a relay has already recorded its own failure
                    self.upstream_failed(ep, r.kind, str(r))
                tried.append(ep)
                self.metrics.retries.labels(r.kind).inc()
            finally:
                if not handed:
                    self.release(ep, n)
        if last is not None and _is_openai_error(last[1]):
            return web.Response(
                status=last[0],
                body=last[1],
                content_type="application/json",
                headers={"X-Request-ID": rid},
            ), "none"
        raise ApiError(
            502,
            f"no endpoint could serve the request after {len(tried)} attempt(s)",
            code="upstream_unavailable",
        )

    def release(self, ep: Endpoint, n: int = 1) -> None:
        self.admission.release(ep, n)
        self._on_release(ep)  # type: ignore[operator]

    def upstream_failed(self, ep: Endpoint, kind: str, detail: str) -> None:
        self.metrics.upstream_errors.labels(ep.name, kind).inc()
        ep.last_error = f"{kind}: {detail}"
        if kind in ("connect", "reset"):
            # Out of rotation until its next health check passes.
            ep.healthy = False
        elif kind in ("ttfb", "stall", "timeout") and self.on_hang is not None:
            # /health may stay green while the engine hangs: out of rotation until it
            # serves a real completion again.
            self.on_hang(ep)
        log.warning("upstream %s failed (%s): %s", ep.name, kind, detail)


async def _read(up: aiohttp.ClientResponse) -> bytes:
    """The whole body; a connection that breaks on the way is the endpoint's fault."""
    try:
        return await up.read()
    except UPSTREAM_ERRORS as e:
        raise Retry("reset", f"{type(e).__name__}: {e}") from None
    finally:
        up.release()


def _request_id(request: web.Request) -> str:
    rid = request.headers.get("X-Request-ID", "")
    return rid if _REQUEST_ID.match(rid) else uuid.uuid4().hex


def _sequences(req: CompletionRequest | ChatRequest, raw: dict[str, Any]) -> int:
    """How many sequences the engine runs for this request: prompts times max(n, best_of)."""
    prompts = 1
    if isinstance(req, CompletionRequest) and isinstance(req.prompt, list):
        p = req.prompt
        prompts = len(p) if p and not isinstance(p[0], int) else 1
    best_of = raw.get("best_of")
    fan = max(req.n, best_of if isinstance(best_of, int) and best_of > 0 else 1)
    return max(prompts, 1) * fan


def _is_openai_error(body: bytes) -> bool:
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    return isinstance(obj, dict) and isinstance(obj.get("error"), dict)
