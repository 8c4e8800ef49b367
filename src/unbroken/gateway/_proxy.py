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
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
from aiohttp import web

from unbroken.gateway._admission import PRIORITIES, Admission
from unbroken.gateway._continuation import augment
from unbroken.gateway._pool import Endpoint, Pool, State
from unbroken.gateway._prefix import RouteHint, hint_of
from unbroken.gateway._ratelimit import Lease, Limiter, RateLimited
from unbroken.gateway._relay import BufferBudget, ClientSink
from unbroken.gateway._stream import StreamRelay
from unbroken.gateway._tenants import NONE, Tenants, priority_for
from unbroken.gateway._upstream import (
    UPSTREAM_ERRORS,
    Form,
    Leg,
    Retry,
    Upstream,
    UpstreamResponse,
)
from unbroken.wire.errors import ApiError
from unbroken.wire.openai import gateway_view, lax_bool

if TYPE_CHECKING:
    from unbroken.config.tenants import TenantSpec
    from unbroken.gateway._metrics import GatewayMetrics
    from unbroken.gateway._server import GatewayConfig

__all__ = ["PASSTHROUGH_ROUTES", "Proxy"]

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
    # The gateway has read the whole body already; an engine's interim answer is not wanted.
    "expect",
}
# Engine routes the gateway forwards without interpreting them (vLLM's names).
PASSTHROUGH_ROUTES = (
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/version"),
    ("POST", "/v1/responses"),
    ("POST", "/v1/embeddings"),
    ("POST", "/pooling"),
    ("POST", "/classify"),
    ("POST", "/score"),
    ("POST", "/v1/score"),
    ("POST", "/rerank"),
    ("POST", "/v1/rerank"),
    ("POST", "/v2/rerank"),
    ("POST", "/v1/audio/transcriptions"),
    ("POST", "/v1/audio/translations"),
)
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,128}$")
# Hang detection learns each endpoint's time to first byte from this many recent streams.
_TTFB_SAMPLES = 32
_TTFB_FACTOR = 4.0
# vLLM's answer to new requests during its graceful shutdown (its /health stays 200).
_SHUTTING_DOWN = "cannot schedule new futures after shutdown"
# This many 5xx in a row (no success between) take an endpoint out until readiness.
_5XX_RUN = 3
_WATCH_S = 0.5
# An endpoint whose streams got an event this recently is producing tokens: slow to answer
# a new request (its queue), not hung.
_ALIVE_S = 1.0
# How long before a first-byte limit fires its endpoint's liveness is looked at.
_PATIENCE_LEAD_S = 0.05
# A non-streaming answer comes whole, its time growing with its tokens: each endpoint learns
# it from this many recent answers (seconds, completion tokens per sequence), and a new
# request may take _ANSWER_FACTOR x the slowest of them scaled to its own max_tokens.
_ANSWER_SAMPLES = 32
_ANSWER_FACTOR = 4.0
# A request without max_tokens is expected to be at most this long (or twice the longest
# answer seen), in tokens per sequence.
_ANSWER_TOKENS_UNKNOWN = 256
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
# Live streams' tokens are charged to their tenant this often (and once more at their end).
METER_S = 0.25


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
        self._answers: dict[str, deque[tuple[float, float]]] = {}
        self._answered: dict[str, float] = {}  # loop time of each endpoint's last answer
        self._5xx: dict[str, int] = {}  # 5xx answers in a row, per endpoint
        # Per endpoint, the kinds of request form it refused (see `open_upstream`).
        self._refused: dict[str, set[str]] = {}
        self.upstream = Upstream(cfg.connect_timeout_s)
        self._watchdog: asyncio.Task[None] | None = None
        self.on_hang: Callable[[Endpoint], None] | None = None  # the prober's `suspect`
        self.pool_keys = {
            pool: key for pool, env in cfg.upstream_key_env.items() if (key := os.environ.get(env))
        }
        # Tenants (issue 25; set by the gateway when `tenants` is configured): who a request
        # is, its limits, the x-ratelimit headers of each request (by its headers dict), and
        # the live streams whose tokens are charged as they come.
        self.tenants: Tenants | None = None
        self.limiter: Limiter | None = None
        self._rl_headers: dict[int, dict[str, str]] = {}
        self._metered: dict[StreamRelay, Lease] = {}
        self._meter: asyncio.Task[None] | None = None

    # -- routes -------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "/v1/completions", chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "/v1/chat/completions", chat=True)

    async def models(self, request: web.Request) -> web.Response:
        """The models of the ready endpoints, with each engine's own fields (vLLM's
        `max_model_len`, `root`, ...); a model no endpoint listed just now keeps a plain
        entry."""
        assert self.session is not None
        eps = [e for e in self.pool.endpoints.values() if e.state == State.READY and e.healthy]
        lists = await asyncio.gather(*(self._models_of(e) for e in eps))
        merged: dict[str, dict[str, Any]] = {}
        for data in lists:
            for m in data:
                merged.setdefault(m["id"], m)
        now = int(time.time())
        live = {m for e in self.pool.endpoints.values() for m in e.models}
        for m in live:
            merged.setdefault(
                m, {"id": m, "object": "model", "created": now, "owned_by": "unbroken"}
            )
        if merged:
            # What a sleeping pool (autoscaled to 0) serves is served too: it wakes on demand.
            for m in self.pool.known_models() - live:
                merged[m] = {"id": m, "object": "model", "created": now, "owned_by": "unbroken"}
        if not merged:
            # Nothing serves yet (engines starting): a script that waits for a 200 and takes
            # data[0] would fail on an empty list; the openai client retries a 503.
            raise ApiError(
                503, "no endpoint is ready yet", code="no_endpoint", headers={"Retry-After": "1"}
            )
        data = [merged[k] for k in sorted(merged)]
        return web.Response(
            body=orjson.dumps({"object": "list", "data": data}), content_type="application/json"
        )

    async def _models_of(self, ep: Endpoint) -> list[dict[str, Any]]:
        assert self.session is not None
        try:
            async with self.session.get(
                ep.url + "/v1/models",
                headers=self.upstream_headers({}, ep),
                timeout=aiohttp.ClientTimeout(total=2.0),
            ) as r:
                if r.status != 200:
                    return []
                obj = orjson.loads(await r.read())
        except (*UPSTREAM_ERRORS, orjson.JSONDecodeError):
            return []
        data = obj.get("data") if isinstance(obj, dict) else None
        if not isinstance(data, list):
            return []
        return [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]

    async def passthrough(self, request: web.Request) -> web.StreamResponse:
        """An engine route the gateway does not interpret (`/tokenize`, `/v1/embeddings`,
        `/v1/responses`, ...): forwarded as is to a ready endpoint of the request's model (of
        any model when it names none), with the same admission, retry before the first byte
        (connect error, 5xx) and 4xx pass-through as completions. A stream is relayed byte for
        byte; it is not migrated if its engine dies mid-way."""
        t0 = time.monotonic()
        rid = _request_id(request)
        priority = self.cfg.default_priority
        status = 500
        pool_label = "none"
        tenant: TenantSpec | None = None
        lease: Lease | None = None
        headers: dict[str, str] | None = None
        try:
            priority, tenant = self._identify(request)
            body = await request.read()
            obj: Any = None
            if body and "json" in (request.content_type or ""):
                try:
                    obj = orjson.loads(body)
                except orjson.JSONDecodeError:
                    obj = None
            model = obj.get("model") if isinstance(obj, dict) else None
            stream = bool(lax_bool(obj.get("stream"))) if isinstance(obj, dict) else False
            known = sorted(self.pool.known_models())
            if not isinstance(model, str) or not model:
                if not known:
                    raise ApiError(
                        503,
                        "no endpoint is ready yet",
                        code="no_endpoint",
                        headers={"Retry-After": "1"},
                    )
                model = known[0]
            elif model not in known:
                raise ApiError(
                    404,
                    f"The model `{model}` does not exist.",
                    param="model",
                    code="model_not_found",
                )
            headers = self._headers(request, rid)
            if body:
                headers["Content-Type"] = request.headers.get("Content-Type", "application/json")
            else:
                del headers["Content-Type"]
            lease = await self._admit_tenant(tenant, headers)
            resp, pool_label = await self._pass(
                request, model, priority, body, headers, stream, t0, tenant, lease
            )
            status = resp.status
            return resp
        except ApiError as e:
            status = e.status
            e.headers.setdefault("X-Request-ID", rid)
            self._rate_headers(e, lease)
            raise
        except asyncio.CancelledError:
            status = 499
            raise
        finally:
            self.metrics.requests.labels(str(status), priority, pool_label).inc()
            if headers is not None:
                self._rl_headers.pop(id(headers), None)
            self._tenant_done(tenant, lease, status)

    async def _pass(
        self,
        request: web.Request,
        model: str,
        priority: str,
        body: bytes,
        headers: dict[str, str],
        stream: bool,
        t0: float,
        tenant: TenantSpec | None = None,
        lease: Lease | None = None,
    ) -> tuple[web.StreamResponse, str]:
        assert self.session is not None
        url_path = request.rel_url.raw_path_qs
        tried: list[Endpoint] = []
        deadline = t0 + self.cfg.request_timeout_s
        for attempt in range(self.cfg.max_attempts):
            if attempt and not self.pool.could_serve(model, priority, tried):
                break
            ep, n, waited = await self.admission.acquire(
                model,
                priority,
                tried,
                size=len(body),
                tenant=None if tenant is None else tenant.name,
                share=1.0 if tenant is None else tenant.weight,
            )
            if tenant is not None:
                self.metrics.tenant_queue_wait.labels(tenant.name).observe(waited)
            try:
                limit = self.ttfb_limit(ep) if stream else deadline - time.monotonic()
                try:
                    async with asyncio.timeout(max(limit, 0.0)):
                        up = await self.session.request(
                            request.method,
                            ep.url + url_path,
                            data=body or None,
                            headers=self.upstream_headers(headers, ep),
                        )
                        sse = up.content_type == "text/event-stream"
                        if up.status != 200 or not sse:
                            data = await _read(up)
                except (*UPSTREAM_ERRORS, Retry) as e:
                    self.upstream_failed(ep, "connect", f"{type(e).__name__}: {e}")
                    tried.append(ep)
                    self.metrics.retries.labels("connect").inc()
                    continue
                if up.status >= 500:
                    self.upstream_failed(
                        ep, f"status_{up.status}", data[:300].decode(errors="replace")
                    )
                    tried.append(ep)
                    self.metrics.retries.labels(f"status_{up.status}").inc()
                    last = web.Response(
                        status=up.status,
                        body=data,
                        content_type=up.content_type,
                        headers=self.response_headers(headers, ep),
                    )
                    if attempt + 1 == self.cfg.max_attempts:
                        return last, ep.pool
                    continue
                if up.status < 400:
                    self.upstream_ok(ep)
                if lease is not None and up.status == 200 and not sse:
                    self._charge_body(lease, data)
                if not sse or up.status != 200:
                    return web.Response(
                        status=up.status,
                        body=data,
                        content_type=up.content_type,
                        headers=self.response_headers(headers, ep),
                    ), ep.pool
                return await self._pass_stream(request, up, ep, headers), ep.pool
            finally:
                self.release(ep, n)
        raise ApiError(
            502,
            f"no endpoint could serve the request after {len(tried)} attempt(s)",
            code="upstream_unavailable",
        )

    async def _pass_stream(
        self,
        request: web.Request,
        up: aiohttp.ClientResponse,
        ep: Endpoint,
        headers: dict[str, str],
    ) -> web.StreamResponse:
        """Relay an event stream byte for byte; a stall past `stall_timeout_s` or a broken
        upstream ends it with an error event (no silent truncation)."""
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                **self.response_headers(headers, ep),
            }
        )
        await resp.prepare(request)
        stall = self.cfg.stall_timeout_s
        it = up.content.iter_any().__aiter__()
        try:
            while True:
                try:
                    async with asyncio.timeout(stall):
                        chunk = await it.__anext__()
                except StopAsyncIteration:
                    break
                await resp.write(chunk)
        except (*UPSTREAM_ERRORS, TimeoutError) as e:
            kind = "stall" if isinstance(e, TimeoutError) else "reset"
            self.upstream_failed(ep, kind, f"pass-through stream: {type(e).__name__}")
            err = {
                "message": f"the upstream stream broke ({kind})",
                "type": "upstream_error",
                "param": None,
                "code": "stream_broken",
            }
            await resp.write(b"event: error\ndata: " + orjson.dumps({"error": err}) + b"\n\n")
        finally:
            up.close()
        await resp.write_eof()
        return resp

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
        tenant: TenantSpec | None = None
        lease: Lease | None = None
        try:
            priority, tenant = self._identify(request)
            body = await request.read()
            view = gateway_view(body, chat)
            model, streaming, weight = view.model, view.stream, view.sequences
            if model is None:
                # The engine serves its one model when none is named; so does the gateway.
                known = self.pool.known_models()
                if len(known) != 1:
                    raise ApiError(
                        400, "'model' is a required property", param="model", code="invalid_value"
                    )
                model = next(iter(known))
            wants = _wants(view.raw) if streaming else None
            tokens = None if streaming else _max_tokens(view.raw)
            hint = self._hint(request, view.raw, chat, model)
            # The body asking the engine for what continuation needs (`augment`), made from
            # the dict parsed above.
            plus = orjson.dumps(augment(view.raw)) if streaming else None
            del view  # a waiter keeps its body's bytes, nothing bigger
            if weight > self.cfg.max_sequences_per_request:
                raise ApiError(
                    400,
                    f"this request asks for {weight} sequences (prompts times max(n, best_of)); "
                    f"the limit is {self.cfg.max_sequences_per_request}",
                    param="n",
                    code="too_many_sequences",
                )
            if not self.pool.serves(model) and self.pool.configured(model) is None:
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
            headers = self._headers(request, rid)
            lease = await self._admit_tenant(tenant, headers)
            resp, pool_label = await self._forward(
                request,
                path,
                model,
                streaming,
                weight,
                body,
                priority,
                t0,
                chat,
                rid,
                wants,
                tokens,
                hint,
                plus,
                headers,
                tenant,
                lease,
            )
            status = resp.status
            return resp
        except ApiError as e:
            status = e.status
            e.headers.setdefault("X-Request-ID", rid)
            if e.status == 429 and not isinstance(e, RateLimited):
                self.metrics.shed.labels(priority, e.code or "shed").inc()
            self._rate_headers(e, lease)
            raise
        except asyncio.CancelledError:
            status = 499  # client closed the request (nginx's convention)
            raise
        finally:
            self.metrics.requests.labels(str(status), priority, pool_label).inc()
            if tenant is not None:
                self._tenant_done(tenant, lease, status)

    def _hint(
        self, request: web.Request, raw: dict[str, Any], chat: bool, model: str
    ) -> RouteHint | None:
        """What a cache- or session-aware policy needs of this request (None for others)."""
        if not getattr(self.pool.policy, "wants_hint", False):
            return None
        return hint_of(
            raw,
            chat,
            model,
            block_chars=self.cfg.prefix_block_chars,
            session=request.headers.get(self.cfg.session_header) or None,
        )

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
        if self._rl_headers and (rl := self._rl_headers.get(id(base))) is not None:
            h.update(rl)
        return h

    # -- tenants ------------------------------------------------------------------------------
    def _identify(self, request: web.Request) -> tuple[str, TenantSpec | None]:
        """The request's priority and tenant. With tenants, the key names the tenant (or
        401) and the tenant's priority is a ceiling the priority header may only lower;
        without, the header, else `priority_keys`, else the default, as before tenants."""
        if self.tenants is None:
            return self._priority(request), None
        try:
            tenant = self.tenants.resolve(request.headers.get("Authorization"))
        except ApiError:
            self.metrics.tenant_rejections.labels(NONE, "invalid_api_key").inc()
            raise
        asked = request.headers.get(self.cfg.priority_header)
        return priority_for(tenant, None if asked is None else self._asked(asked)), tenant

    def _asked(self, value: str) -> str:
        value = value.strip().lower()
        if value not in PRIORITIES:
            raise ApiError(
                400,
                f"{self.cfg.priority_header} must be one of {', '.join(PRIORITIES)}, got {value!r}",
                param=self.cfg.priority_header,
                code="invalid_priority",
            )
        return value

    async def _admit_tenant(
        self, tenant: TenantSpec | None, headers: dict[str, str]
    ) -> Lease | None:
        """Take the request from its tenant's limits (429 when over one); its x-ratelimit
        headers go on every response it gets (`response_headers`)."""
        if tenant is None or self.limiter is None:
            return None
        try:
            lease = await self.limiter.admit(tenant.name)
        except RateLimited as e:
            self.metrics.tenant_rejections.labels(tenant.name, e.reason).inc()
            raise
        if lease.headers:
            self._rl_headers[id(headers)] = lease.headers
        return lease

    def _rate_headers(self, e: ApiError, lease: Lease | None) -> None:
        if lease is not None and lease.headers:
            for k, v in lease.headers.items():
                e.headers.setdefault(k, v)

    def _charge(self, lease: Lease, prompt: int | None, completion: int | None) -> None:
        """Charge a request's token totals so far (what is new of them) to its tenant."""
        assert self.limiter is not None
        p0, c0 = lease.prompt, lease.completion
        self.limiter.charge(lease, prompt, completion)
        if lease.prompt > p0:
            self.metrics.tenant_tokens.labels(lease.tenant, "prompt").inc(lease.prompt - p0)
        if lease.completion > c0:
            self.metrics.tenant_tokens.labels(lease.tenant, "completion").inc(lease.completion - c0)

    def _charge_body(self, lease: Lease, data: bytes | None) -> None:
        """A whole answer's usage (non-streaming: one body, never continued)."""
        if not data:
            return
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            return
        u = obj.get("usage") if isinstance(obj, dict) else None
        if isinstance(u, dict):
            pt, ct = u.get("prompt_tokens"), u.get("completion_tokens")
            self._charge(
                lease,
                pt if isinstance(pt, int) else None,
                ct if isinstance(ct, int) else None,
            )

    def _tenant_done(self, tenant: TenantSpec | None, lease: Lease | None, status: int) -> None:
        if tenant is None:
            return
        self.metrics.tenant_requests.labels(tenant.name, str(status)).inc()
        if lease is not None and self.limiter is not None:
            self.limiter.finish(lease)

    def _metering(self, relay: StreamRelay, lease: Lease | None) -> None:
        """Charge a live stream's tokens as they come (every METER_S), not only at its end,
        so a tenant's token limits see long streams while they run."""
        if lease is None:
            return
        self._metered[relay] = lease
        if self._meter is None or self._meter.done():
            self._meter = asyncio.get_running_loop().create_task(self._meter_loop())

    def _metered_end(self, relay: StreamRelay) -> None:
        lease = self._metered.pop(relay, None)
        if lease is not None:
            self._charge(lease, relay.x.prompt_tokens, relay.x.sent)

    async def _meter_loop(self) -> None:
        while self._metered:
            await asyncio.sleep(METER_S)
            for relay, lease in list(self._metered.items()):
                self._charge(lease, relay.x.prompt_tokens, relay.x.sent)

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

    def answer_limit(self, ep: Endpoint, tokens: int | None) -> float:
        """How long `ep` may take to answer a non-streaming request for `tokens` tokens per
        sequence: `_ANSWER_FACTOR` x the slowest recent answer of `ep` scaled by token count,
        at least `ttfb_min_s`. Until `ep` has answered, its warm-up is
        its one sample; with no warm-up either, its pool's answers; with none, the ceiling
        `ttfb_timeout_s` (streams' first-byte limit before they learn)."""
        cfg = self.cfg
        samples: list[tuple[float, float]] = list(self._answers.get(ep.name, ()))
        if ep.warmup_s is not None:
            samples.append((ep.warmup_s, 1.0))
        if not samples:
            for e in self.pool.endpoints.values():
                if e.pool == ep.pool:
                    samples.extend(self._answers.get(e.name, ()))
        if not samples:
            return cfg.ttfb_timeout_s
        if tokens is None:
            tokens = max(_ANSWER_TOKENS_UNKNOWN, 2 * int(max(k for _, k in samples)))
        est = max(s * (tokens + 1) / (k + 1) for s, k in samples)
        return max(cfg.ttfb_min_s, _ANSWER_FACTOR * est)

    def observe_answer(self, ep: Endpoint, seconds: float, body: bytes, sequences: int) -> None:
        """A non-streaming answer came whole after `seconds`: a sample for `answer_limit`, and
        a sign of life (`alive`)."""
        self._answered[ep.name] = asyncio.get_running_loop().time()
        m = _COMPLETION_TOKENS.search(body)
        tokens = int(m[1]) / max(1, sequences) if m else 0.0
        q = self._answers.get(ep.name)
        if q is None:
            q = self._answers[ep.name] = deque(maxlen=_ANSWER_SAMPLES)
        q.append((seconds, tokens))

    def answer_patience(
        self,
        model: str,
        priority: str,
        exclude: list[Endpoint],
        deadline: float,
        tokens: int | None,
    ) -> Callable[[Endpoint], Callable[[float], float | None]]:
        """The rule for a non-streaming answer that is late (see `patience`): an endpoint
        still alive (it answers other requests, its streams get events) is busy, not hung,
        and with no other endpoint to try there is nothing better than to wait; either way
        wait its limit again, never past the request's `deadline` (monotonic). Otherwise the
        limit fires and the request is tried elsewhere (nothing was sent to the client)."""
        loop = asyncio.get_running_loop()
        # Loop time and time.monotonic() need not share an origin (uvloop).
        end = deadline - time.monotonic() + loop.time()

        def rule(ep: Endpoint) -> Callable[[float], float | None]:
            def decide(now: float) -> float | None:
                if now >= end:
                    return None
                if self.alive(ep) or not self.pool.could_serve(model, priority, [*exclude, ep]):
                    return min(end, now + self.answer_limit(ep, tokens))
                return None

            return decide

        return rule

    # -- the one way upstream ---------------------------------------------------------------
    async def open_upstream(
        self,
        model: str,
        priority: str,
        forms: Sequence[Form],
        exclude: list[Endpoint],
        *,
        limit: Callable[[Endpoint], float],
        streaming: bool = True,
        answer: Callable[[Endpoint], Callable[[float], float | None]] | None = None,
        deadline: float | None = None,
        weight: int = 1,
        size: int = 0,
        headers: dict[str, str],
        hint: RouteHint | None = None,
        tenant: TenantSpec | None = None,
    ) -> Leg:
        """One attempt: wait for slots on an endpoint not in `exclude` (admission), then send
        `forms` in order until the engine does not refuse one with a 4xx; an engine that
        refused a sticky form while taking a later one is not asked for it again. Returns
        the leg, slots held, with whatever HTTP answer it got (the body read unless it is a
        200 stream). A connection failure or the time limit `limit(ep)` is recorded on the
        endpoint, which is added to `exclude`, its slots released, and raises Retry. Leg 0
        of a request and every continuation of a stream come through here. A non-streaming
        request passes the rule for a late `answer` (`answer_patience`) and its `deadline`
        (monotonic): its limit firing before the deadline is a hang ("answer", tried
        elsewhere), at the deadline a timeout."""
        ep, n, waited = await self.admission.acquire(
            model,
            priority,
            exclude,
            weight=weight,
            size=size,
            hint=hint,
            tenant=None if tenant is None else tenant.name,
            share=1.0 if tenant is None else tenant.weight,
        )
        self.pool.admitted(ep, model, priority, hint)
        if waited:
            self.metrics.queue_wait.labels(priority).observe(waited)
        if tenant is not None:
            self.metrics.tenant_queue_wait.labels(tenant.name).observe(waited)
        hdrs = self.upstream_headers(headers, ep)
        refused = self._refused.get(ep.name, ())
        todo = [f for f in forms if f.kind not in refused] or list(forms[-1:])
        t = max(limit(ep), 0.0)
        tmo = asyncio.timeout(t)
        up: UpstreamResponse | None = None
        stop_waiting: Callable[[], None] | None = None
        sent = time.monotonic()
        try:
            async with tmo:
                if streaming:
                    start = asyncio.get_running_loop().time()
                    stop_waiting = self.patience(tmo, self.first_byte_patience(ep, start))
                elif answer is not None:
                    stop_waiting = self.patience(tmo, answer(ep))
                for i, form in enumerate(todo):
                    up = await self.upstream.request(ep.url, form.path, form.body, hdrs)
                    if up.status == 200 and streaming:
                        data = None
                    else:
                        try:
                            data = await up.read()
                        except ConnectionError as e:
                            raise Retry("reset", f"{type(e).__name__}: {e}") from None
                    if 400 <= up.status < 500 and i + 1 < len(todo):
                        log.info(
                            "%s refused a %s request: HTTP %d %s",
                            ep.name,
                            form.kind,
                            up.status,
                            (data or b"")[:200].decode(errors="replace"),
                        )
                        if form.sticky:
                            skipped = self._refused.setdefault(ep.name, set())
                            if form.kind not in skipped:
                                skipped.add(form.kind)
                                log.info("%s refuses %s requests", ep.name, form.kind)
                        continue
                    if up.status < 500:
                        self.upstream_ok(ep)
                    if up.status == 200 and not streaming and data is not None:
                        self.observe_answer(ep, time.monotonic() - sent, data, weight)
                    return Leg(up, ep, n, form.kind, data)
        except (*UPSTREAM_ERRORS, Retry) as e:
            if isinstance(e, Retry):
                kind, detail = e.kind, str(e)
            elif tmo.expired():
                took = time.monotonic() - sent
                if streaming:
                    kind = "ttfb"
                elif deadline is not None and time.monotonic() < deadline - 0.01:
                    kind = "answer"
                else:
                    kind = "timeout"
                detail = f"no answer within {took:.1f} s"
            else:
                kind, detail = "connect", f"{type(e).__name__}: {e}"
            if up is not None:
                up.close()
            self.upstream_failed(ep, kind, detail)
            exclude.append(ep)
            self.release(ep, n)
            raise Retry(kind, detail) from None
        except BaseException:
            if up is not None:
                up.close()
            self.release(ep, n)
            raise
        finally:
            if stop_waiting is not None:
                stop_waiting()
        raise AssertionError("unreachable: the last form always returns")

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
        wants: tuple[bool, bool, bool] | None = None,
        tokens: int | None = None,
        hint: RouteHint | None = None,
        augmented: bytes | None = None,
        headers: dict[str, str] | None = None,
        tenant: TenantSpec | None = None,
        lease: Lease | None = None,
    ) -> tuple[web.StreamResponse, str]:
        """Send the request to an endpoint, trying others (at most `max_attempts`) while
        nothing was sent to the client. A non-streaming request (`tokens`: its max_tokens)
        has the learned `answer_limit` per attempt, all attempts within `request_timeout_s`.
        `tenant`'s turn in the queue is by its weight; `lease` is charged its tokens."""
        if headers is None:
            headers = self._headers(request, rid)
        try:
            return await self._attempts(
                request,
                path,
                model,
                streaming,
                weight,
                body,
                priority,
                t0,
                chat,
                rid,
                wants,
                tokens,
                hint,
                augmented,
                headers,
                tenant,
                lease,
            )
        finally:
            self._rl_headers.pop(id(headers), None)

    async def _attempts(
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
        wants: tuple[bool, bool, bool] | None,
        tokens: int | None,
        hint: RouteHint | None,
        augmented: bytes | None,
        headers: dict[str, str],
        tenant: TenantSpec | None,
        lease: Lease | None,
    ) -> tuple[web.StreamResponse, str]:
        # A stream asks the engine for exact token counts and ids (see `_continuation.augment`);
        # an engine that refuses them (4xx) gets the client's own body, and is remembered.
        forms = [Form("plain", path, body)]
        if augmented is not None:
            forms.insert(0, Form("augmented", path, augmented, sticky=True))
        tried: list[Endpoint] = []
        last: tuple[int, bytes] | None = None
        deadline = t0 + self.cfg.request_timeout_s  # non-streaming requests, all attempts

        def limit(ep: Endpoint) -> float:
            if streaming:
                return self.ttfb_limit(ep)
            return min(deadline - time.monotonic(), self.answer_limit(ep, tokens))

        answer = (
            None if streaming else self.answer_patience(model, priority, tried, deadline, tokens)
        )

        for attempt in range(self.cfg.max_attempts):
            if attempt and not self.pool.could_serve(model, priority, tried):
                break
            try:
                leg = await self.open_upstream(
                    model,
                    priority,
                    forms,
                    tried,
                    limit=limit,
                    streaming=streaming,
                    answer=answer,
                    deadline=None if streaming else deadline,
                    weight=weight,
                    size=len(body),
                    headers=headers,
                    hint=hint,
                    tenant=tenant,
                )
            except Retry as r:
                self.metrics.retries.labels(r.kind).inc()
                if r.kind == "timeout":
                    raise ApiError(
                        504,
                        f"the engine did not answer within {self.cfg.request_timeout_s:g} s",
                        code="upstream_timeout",
                    ) from None
                continue
            ep, up = leg.ep, leg.up
            if up.status != 200 or not streaming:
                self.release(ep, leg.n)
                data = leg.data or b""
                if lease is not None and up.status == 200:
                    self._charge_body(lease, data)
                if up.status >= 500:
                    same = last is not None and (up.status, data) == last
                    last = (up.status, data)
                    if same:
                        # A second endpoint fails the same way on the same body: the body is
                        # the cause. Not this endpoint's fault, and no third try.
                        log.info("upstream %s: HTTP %d again for this body", ep.name, up.status)
                        break
                    kind = f"status_{up.status}"
                    self.upstream_failed(
                        ep, kind, f"HTTP {up.status}: {data[:300].decode(errors='replace')}"
                    )
                    tried.append(ep)
                    self.metrics.retries.labels(kind).inc()
                    continue
                # A 4xx is the request's fault: passed on as is, never retried elsewhere.
                return web.Response(
                    status=up.status,
                    body=data,
                    content_type=up.content_type or "application/json",
                    headers=self.response_headers(headers, ep),
                ), ep.pool
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
                augmented=leg.kind == "augmented",
                wants=wants or (False, False, False),
                hint=hint,
            )
            self._metering(relay, lease)
            try:
                return await relay.run(up, ep, leg.n), ep.pool
            except Retry as r:  # the relay has recorded its own failure, released its slots
                tried.append(ep)
                self.metrics.retries.labels(r.kind).inc()
            finally:
                if lease is not None:
                    self._metered_end(relay)
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

    def could_serve(self, model: str, priority: str, exclude: list[Endpoint]) -> bool:
        return self.pool.could_serve(model, priority, exclude)

    async def detokenize(
        self, model: str, ids: list[int], exclude: list[Endpoint], headers: dict[str, str]
    ) -> str | None:
        """The text of `ids` as a ready endpoint of `model` (not in `exclude`) decodes it;
        None when none answers."""
        ep = next(
            (
                e
                for e in self.pool.endpoints.values()
                if e.state == State.READY and e.healthy and model in e.models and e not in exclude
            ),
            None,
        )
        if ep is None or self.session is None:
            return None
        try:
            async with self.session.post(
                ep.url + "/detokenize",
                data=orjson.dumps({"model": model, "tokens": ids}),
                headers=self.upstream_headers(headers, ep),
                timeout=aiohttp.ClientTimeout(total=2.0),
            ) as r:
                if r.status != 200:
                    return None
                text = orjson.loads(await r.read()).get("prompt")
        except (*UPSTREAM_ERRORS, orjson.JSONDecodeError, AttributeError):
            return None
        return text if isinstance(text, str) else None

    def stream_sink(self, request: web.Request, resp: web.StreamResponse) -> ClientSink:
        """The sink of a stream's client, counted in the buffered-bytes gauge and the budget
        until `drop_sink`."""
        sink = ClientSink(resp, request.transport, self.cfg.stream_buffer_bytes, self.buffer_budget)
        self.sinks.add(sink)
        return sink

    def drop_sink(self, sink: ClientSink) -> None:
        sink.detach()
        self.sinks.discard(sink)

    def release(self, ep: Endpoint, n: int = 1) -> None:
        self.admission.release(ep, n)
        self._on_release(ep)  # type: ignore[operator]

    def watch_streams(self) -> None:
        """Start the watch over streams on endpoints that leave rotation (once)."""
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        """Streams of an endpoint out of rotation (its /health failing, a sibling stream
        reset, hung) get the short stall limit: a dying engine that keeps its connections
        open without events is left in about a second."""
        while True:
            await asyncio.sleep(_WATCH_S)
            for ep in list(self.pool.endpoints.values()):
                if ep.relays and not ep.healthy:
                    for relay in list(ep.relays):
                        relay.alert()

    def alive(self, ep: Endpoint) -> bool:
        """Did any stream of `ep` get an event, or a request an answer, in the last
        `_ALIVE_S`?"""
        since = asyncio.get_running_loop().time() - _ALIVE_S
        if self._answered.get(ep.name, 0.0) > since:
            return True
        return any(r.last_event > since for r in list(ep.relays))

    def first_byte_patience(self, ep: Endpoint, start: float) -> Callable[[float], float | None]:
        """The rule for a first byte that is late (see `patience`): while `ep` is alive, an
        engine producing tokens for its other streams and slow to start this one has a queue,
        not a hang (under saturation, cutting such requests only turned a slow answer into a
        502); wait the endpoint's limit again, never past `start` + `ttfb_timeout_s`."""
        ceiling = start + self.cfg.ttfb_timeout_s

        def decide(now: float) -> float | None:
            if now < ceiling and self.alive(ep):
                return min(ceiling, now + self.ttfb_limit(ep))
            return None

        return decide

    def patience(
        self, tmo: asyncio.Timeout, decide: Callable[[float], float | None]
    ) -> Callable[[], None]:
        """Just before the time limit `tmo` fires, ask `decide(now)`: a new deadline pushes
        it back (and is watched the same way), None lets it fire. Returns the function that
        stops watching."""
        loop = asyncio.get_running_loop()
        handle: asyncio.TimerHandle | None = None

        def check() -> None:
            nonlocal handle
            when = tmo.when()
            if when is None or tmo.expired():
                return
            now = loop.time()
            if when - now > _PATIENCE_LEAD_S:  # moved since (an event re-armed it)
                handle = loop.call_at(when - _PATIENCE_LEAD_S, check)
            elif (new := decide(now)) is not None and new > when:
                tmo.reschedule(new)
                handle = loop.call_at(new - _PATIENCE_LEAD_S, check)

        def stop() -> None:
            if handle is not None:
                handle.cancel()

        first = tmo.when()
        if first is not None:
            handle = loop.call_at(first - _PATIENCE_LEAD_S, check)
        return stop

    def upstream_ok(self, ep: Endpoint) -> None:
        self._5xx.pop(ep.name, None)

    def upstream_failed(self, ep: Endpoint, kind: str, detail: str) -> None:
        self.metrics.upstream_errors.labels(ep.name, kind).inc()
        ep.last_error = f"{kind}: {detail}"
        run = 0
        if kind.startswith("status_5"):
            run = self._5xx[ep.name] = self._5xx.get(ep.name, 0) + 1
        if kind in ("connect", "reset"):
            # Out of rotation until its next health check passes.
            ep.healthy = False
        elif kind in ("ttfb", "stall", "timeout", "answer") and self.alive(ep):
            log.warning(
                "upstream %s slow (%s: %s), not hung: its other streams got events within "
                "%.0f s; it stays in rotation",
                ep.name,
                kind,
                detail,
                _ALIVE_S,
            )
            return
        elif self.on_hang is not None and (
            kind in ("ttfb", "stall", "timeout", "answer", "abort", "protocol")
            or _SHUTTING_DOWN in detail
            or run >= _5XX_RUN
        ):
            # /health may stay green while the engine hangs, or while it shuts down (vLLM
            # answers 200 there and refuses new requests with a 500): out of rotation until
            # it serves a real completion again (readiness).
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


def _max_tokens(raw: dict[str, Any]) -> int | None:
    """The request's token limit per sequence (chat's `max_completion_tokens` first), None
    when it sets none (the engine then fills the context)."""
    for key in ("max_completion_tokens", "max_tokens"):
        v = raw.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def _request_id(request: web.Request) -> str:
    rid = request.headers.get("X-Request-ID", "")
    return rid if _REQUEST_ID.match(rid) else uuid.uuid4().hex


def _wants(raw: dict[str, Any]) -> tuple[bool, bool, bool]:
    """What the client asked of the stream: (include_usage, continuous_usage_stats,
    return_token_ids). The relay strips what it did not ask for."""
    so = raw.get("stream_options")
    so = so if isinstance(so, dict) else {}
    return (
        bool(lax_bool(so.get("include_usage"))),
        bool(lax_bool(so.get("continuous_usage_stats"))),
        bool(lax_bool(raw.get("return_token_ids"))),
    )


def _is_openai_error(body: bytes) -> bool:
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    return isinstance(obj, dict) and isinstance(obj.get("error"), dict)
