"""The proxy's HTTP face: the OpenAI routes (`completions`, `chat`), `/v1/models`, and the
engine routes it forwards without interpreting them (`passthrough`).

A completion is read only as far as the gateway needs (`wire.openai.gateway_view`: model,
stream, sequences), its tenant and priority identified (`_tenancy`), its limits checked, and
then handed to the attempt loop (`_forward.Forwarder`). The parts used here (`tenancy`,
`headers`, `legs`, `health`, `forwarder`) are built by `_proxy.Proxy`, which is this class.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
from aiohttp import web

from unbroken.gateway._continuation import augment, augmentable
from unbroken.gateway._engine_routes import EngineRoutes, ResponseHomes, StreamScan
from unbroken.gateway._forward import Completion, Forwarder
from unbroken.gateway._headers import Headers, request_id
from unbroken.gateway._health import EndpointHealth
from unbroken.gateway._legs import Legs
from unbroken.gateway._pool import Endpoint, Pool, State
from unbroken.gateway._prefix import (
    CHARS_PER_TOKEN,
    RouteHint,
    hint_of,
    messages_as_chat,
    responses_as_chat,
)
from unbroken.gateway._ratelimit import Lease, RateLimited
from unbroken.gateway._tenancy import Tenancy
from unbroken.gateway._upstream import UPSTREAM_ERRORS, Retry
from unbroken.wire.errors import ApiError, model_not_found
from unbroken.wire.openai import gateway_view, lax_bool

if TYPE_CHECKING:
    from unbroken.config.spec import GatewaySettings
    from unbroken.config.tenants import TenantSpec
    from unbroken.gateway._metrics import GatewayMetrics

__all__ = ["MODELS_FRESH_S", "PASSTHROUGH_ROUTES", "Handlers"]

# A request naming a model no endpoint is known to serve makes the engines' models be read
# again (`_learned`), one read at a time and at most one per MODELS_FRESH_S (a flood of
# unknown names: at most 20 reads of each engine's /v1/models a second), waiting at most
# MODELS_WAIT_S.
MODELS_FRESH_S = 0.05
MODELS_WAIT_S = 3.0

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
    # Anthropic's Messages API (Claude Code and its SDK pointed at vLLM), SageMaker's.
    ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
    ("POST", "/invocations"),
)
# Routes whose body is a conversation in another API's shape, read as chat's for routing.
_AS_CHAT = {"/v1/responses": responses_as_chat, "/v1/messages": messages_as_chat}


class Handlers(EngineRoutes):
    """The route handlers; the parts they use are set by `Proxy.__init__`."""

    cfg: GatewaySettings
    pool: Pool
    metrics: GatewayMetrics
    session: aiohttp.ClientSession | None
    headers: Headers
    health: EndpointHealth
    tenancy: Tenancy
    legs: Legs
    forwarder: Forwarder
    homes: ResponseHomes
    # Each model's card as an engine last listed it (`max_model_len`, `root`, `permission`):
    # what a sleeping pool's model is listed with until it wakes.
    cards_seen: dict[str, dict[str, Any]]
    # Reads every ready engine's /v1/models now: the prober's (one process) or the main
    # process's through the control socket (a worker); None: no such reader.
    read_models: Callable[[], Awaitable[None]] | None = None
    _reading_models: asyncio.Future[None] | None = None
    _models_read_at = 0.0

    async def _learned(self, model: str) -> bool:
        """Whether `model` is served after the engines' models were read again: a request
        named a model no endpoint is known to serve. An adapter loaded at runtime
        (`/v1/load_lora_adapter`) is served by its engine from that moment, while the prober
        reads models again only at its next probe, and only on engines whose
        `vllm:lora_requests_info` shows, which real vLLM exposes after its first request:
        without this read such an adapter got a 404 (found on real vLLM,
        tests/vllm/test_vllm_canonical.py). One read at a time, none within MODELS_FRESH_S of the
        last (a request then gets its 404 at once)."""
        if self.read_models is None:
            return False
        task = self._reading_models
        if task is None:
            if time.monotonic() - self._models_read_at < MODELS_FRESH_S:
                return False
            task = self._reading_models = asyncio.ensure_future(self._read_models())
        await asyncio.shield(task)
        return self.pool.serves(model)

    async def _read_models(self) -> None:
        assert self.read_models is not None
        try:
            await asyncio.wait_for(self.read_models(), MODELS_WAIT_S)
        except (TimeoutError, *UPSTREAM_ERRORS):
            pass
        finally:
            self._models_read_at = time.monotonic()
            self._reading_models = None

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "/v1/completions", chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "/v1/chat/completions", chat=True)

    async def models(self, request: web.Request) -> web.Response:
        """The models of the ready endpoints, with each engine's own fields (vLLM's
        `max_model_len`, `root`, ...); a model no endpoint listed just now keeps a plain
        entry. With tenants, only for a known key (or the `anonymous` tenant), as vLLM with
        `--api-key` guards every /v1 route: the served names are not for anyone who asks."""
        data = await self._model_cards(request)
        return web.Response(
            body=orjson.dumps({"object": "list", "data": data}), content_type="application/json"
        )

    async def model(self, request: web.Request) -> web.Response:
        """OpenAI's `GET /v1/models/{model}` (the openai client's `models.retrieve`; vLLM
        has no such route): the card `/v1/models` lists for it, else OpenAI's 404."""
        want = request.match_info["model"]
        for card in await self._model_cards(request):
            if card["id"] == want:
                return web.Response(body=orjson.dumps(card), content_type="application/json")
        raise model_not_found(want)

    async def _model_cards(self, request: web.Request) -> list[dict[str, Any]]:
        assert self.session is not None
        tenant = self.tenancy.resolve(request) if self.tenancy.tenants is not None else None
        # In the spec's pool order, then by name: data[0] is the first pool's model in every
        # answer, not whichever replica passed its health check first.
        rank = {p: i for i, p in enumerate([*self.pool.pool_models, *self.pool.pool_order])}
        eps = sorted(
            (e for e in self.pool.endpoints.values() if e.state == State.READY and e.healthy),
            key=lambda e: (rank.get(e.pool, len(rank)), e.name),
        )
        lists = await asyncio.gather(*(self._models_of(e) for e in eps))
        merged: dict[str, dict[str, Any]] = {}
        for data in lists:
            for m in data:
                merged.setdefault(m["id"], m)
        seen = self.cards_seen
        seen.update(merged)
        now = int(time.time())
        live = {m for e in self.pool.endpoints.values() for m in e.models}
        for m in live:
            merged.setdefault(
                m, {"id": m, "object": "model", "created": now, "owned_by": "unbroken"}
            )
        if merged:
            # What a sleeping pool (autoscaled to 0) serves is served too: it wakes on demand.
            # Its card is the one its engine last listed; never awake since this gateway
            # started: a plain card, an adapter with its base and path as vLLM lists it.
            cards = self.cfg.adapter_cards
            for m in self.pool.known_models() - live:
                if (last := seen.get(m)) is not None:
                    merged[m] = {**last, "created": now}  # as its engine listed it
                    continue
                merged[m] = {"id": m, "object": "model", "created": now, "owned_by": "unbroken"}
                if m in cards:
                    merged[m].update(root=cards[m]["root"], parent=cards[m]["parent"])
        if not merged:
            # Nothing serves yet (engines starting): a script that waits for a 200 and takes
            # data[0] would fail on an empty list; the openai client retries a 503.
            raise ApiError(
                503, "no endpoint is ready yet", code="no_endpoint", headers={"Retry-After": "1"}
            )
        # vLLM lists its served model names first, then its adapters (`parent`: the base), and
        # scripts take data[0] as the model: the engines' own order (endpoints in the spec's
        # pool order), bases before adapters; names no engine listed just now after. A tenant
        # limited to some models sees those.
        cards = [m for m in merged.values() if self.tenancy.may_use(tenant, m["id"])]
        return sorted(cards, key=lambda m: m.get("parent") is not None)

    async def _models_of(self, ep: Endpoint) -> list[dict[str, Any]]:
        assert self.session is not None
        try:
            async with self.session.get(
                ep.url + "/v1/models",
                headers=self.headers.upstream({}, ep),
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
        byte; it is not migrated if its engine dies mid-way. A Responses API turn that
        continues a stored response (`previous_response_id`) goes to the replica that holds
        it (`ResponseHomes`; else each in turn until one does not answer 404)."""
        t0 = time.monotonic()
        rid = request_id(request)
        priority = self.cfg.default_priority
        status = 500
        pool_label = "none"
        tenant: TenantSpec | None = None
        lease: Lease | None = None
        headers: dict[str, str] | None = None
        try:
            priority, tenant = self.tenancy.identify(request)
            body = await request.read()
            obj: Any = None
            if body and "json" in (request.content_type or ""):
                try:
                    obj = orjson.loads(body)
                except orjson.JSONDecodeError:
                    obj = None
            model = obj.get("model") if isinstance(obj, dict) else None
            stream = bool(lax_bool(obj.get("stream"))) if isinstance(obj, dict) else False
            prev = obj.get("previous_response_id") if isinstance(obj, dict) else None
            home = self.homes.get(prev) if isinstance(prev, str) else None
            known = sorted(self.pool.known_models())
            if not isinstance(model, str) or not model:
                if not known:
                    raise ApiError(
                        503,
                        "no endpoint is ready yet",
                        code="no_endpoint",
                        headers={"Retry-After": "1"},
                    )
                # No model named: the first served one this tenant may use.
                model = next((m for m in known if self.tenancy.may_use(tenant, m)), known[0])
            elif model not in known and not await self._learned(model):
                raise model_not_found(model)
            self.tenancy.check_model(tenant, model)
            headers = self.headers.of(request, rid)
            if body:
                headers["Content-Type"] = request.headers.get("Content-Type", "application/json")
            else:
                del headers["Content-Type"]
            lease = await self.tenancy.admit(tenant, headers)
            hint = None
            as_chat = _AS_CHAT.get(request.path)
            if home is None and as_chat is not None and isinstance(obj, dict):
                hint = self._hint(request, obj, True, model, as_chat=as_chat)
            resp, pool_label = await self._pass(
                request,
                model,
                priority,
                body,
                headers,
                stream,
                t0,
                tenant,
                lease,
                home=home,
                hunt=isinstance(prev, str),
                hint=hint,
            )
            status = resp.status
            return resp
        except ApiError as e:
            status = e.status
            e.headers.setdefault("X-Request-ID", rid)
            self.tenancy.rate_headers(e, lease)
            raise
        except asyncio.CancelledError:
            status = 499
            raise
        finally:
            self.metrics.requests.labels(str(status), priority, pool_label).inc()
            if headers is not None:
                self.headers.done(headers)
            self.tenancy.done(tenant, lease, status)

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
        *,
        home: str | None = None,
        hunt: bool = False,
        hint: RouteHint | None = None,
    ) -> tuple[web.StreamResponse, str]:
        """`home`: the endpoint to ask first; `hunt`: a 404 means "not held here" (a stored
        response), so each endpoint is asked in turn; `hint`: a Responses API request's
        prompt and session, for prefix- and session-aware routing as chat's."""
        assert self.session is not None
        url_path = request.rel_url.raw_path_qs
        notes = request.path == "/v1/responses"
        tried: list[Endpoint] = []
        deadline = t0 + self.cfg.request_timeout_s
        attempts = self.cfg.max_attempts
        if hunt:
            attempts = max(attempts, len(self.pool.endpoints))
        not_here: web.Response | None = None
        for attempt in range(attempts):
            if attempt and not self.pool.could_serve(model, priority, tried):
                break
            exclude = tried
            h = self.pool.endpoints.get(home) if attempt == 0 and home else None
            if h is not None:
                others = [e for e in self.pool.endpoints.values() if e is not h]
                if self.pool.could_serve(model, priority, others):
                    exclude = others
            ep, n = await self.legs.admit(
                model, priority, exclude, size=len(body), tenant=tenant, leg=False, hint=hint
            )
            try:
                limit = self.health.ttfb_limit(ep) if stream else deadline - time.monotonic()
                try:
                    async with asyncio.timeout(max(limit, 0.0)):
                        up = await self.session.request(
                            request.method,
                            ep.url + url_path,
                            data=body or None,
                            headers=self.headers.upstream(headers, ep),
                        )
                        if hint is not None:
                            # Sent (its answer's head is here): the policy records where its
                            # prompt went, once per attempt.
                            self.pool.admitted(ep, model, priority, hint)
                        sse = up.content_type == "text/event-stream"
                        if up.status != 200 or not sse:
                            data = await _read(up)
                except (*UPSTREAM_ERRORS, Retry) as e:
                    self.health.upstream_failed(ep, "connect", f"{type(e).__name__}: {e}")
                    tried.append(ep)
                    self.metrics.retries.labels("connect").inc()
                    continue
                if up.status >= 500:
                    self.health.upstream_failed(
                        ep, f"status_{up.status}", data[:300].decode(errors="replace")
                    )
                    tried.append(ep)
                    self.metrics.retries.labels(f"status_{up.status}").inc()
                    last = web.Response(
                        status=up.status,
                        body=data,
                        content_type=up.content_type,
                        headers=self.headers.response(headers, ep),
                    )
                    if attempt + 1 == attempts:
                        return last, ep.pool
                    continue
                if up.status < 400:
                    self.health.upstream_ok(ep)
                if up.status == 404 and hunt:
                    tried.append(ep)
                    not_here = web.Response(
                        status=404,
                        body=data,
                        content_type=up.content_type,
                        headers=self.headers.response(headers, ep),
                    )
                    continue
                if up.status == 200 and not sse and (lease is not None or notes):
                    obj = _json(data)  # parsed once for both
                    if lease is not None:
                        self.tenancy.charge_answer(lease, obj)
                    if notes:
                        self.homes.note_answer(obj, ep)
                if not sse or up.status != 200:
                    return web.Response(
                        status=up.status,
                        body=data,
                        content_type=up.content_type,
                        headers=self.headers.response(headers, ep),
                    ), ep.pool
                scan = (
                    StreamScan(ep, self.homes if notes else None, lease, self.tenancy.charge)
                    if notes or lease is not None
                    else None
                )
                return await self._pass_stream(request, up, ep, headers, scan), ep.pool
            finally:
                self.legs.release(ep, n)
        if not_here is not None:
            return not_here, "none"
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
        scan: StreamScan | None = None,
    ) -> web.StreamResponse:
        """Relay an event stream byte for byte; a stall past `stall_timeout_s` or a broken
        upstream ends it with an error event (no silent truncation). `scan` reads the
        stream's usage (the tenant's tokens) and a stored response's id on the way."""
        resp = web.StreamResponse(
            headers={
                "Content-Type": up.headers.get("Content-Type", "text/event-stream"),
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",  # as the engine and the completions' streams
                **self.headers.response(headers, ep),
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
                if scan is not None:
                    scan.feed(chunk)
                await resp.write(chunk)
        except (*UPSTREAM_ERRORS, TimeoutError) as e:
            kind = "stall" if isinstance(e, TimeoutError) else "reset"
            self.health.upstream_failed(ep, kind, f"pass-through stream: {type(e).__name__}")
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

    async def _handle(self, request: web.Request, path: str, *, chat: bool) -> web.StreamResponse:
        t0 = time.monotonic()
        priority = self.cfg.default_priority
        pool_label = "none"
        status = 500
        rid = request_id(request)
        tenant: TenantSpec | None = None
        lease: Lease | None = None
        c: Completion | None = None
        try:
            priority, tenant = self.tenancy.identify(request)
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
            self.tenancy.check_model(tenant, model)
            wants = _wants(view.raw) if streaming else None
            most = _max_tokens(view.raw)
            tokens = None if streaming else most
            hint = self._hint(request, view.raw, chat, model)
            # The body asking the engine for what continuation needs (`augment`), made from
            # the dict parsed above.
            plus = orjson.dumps(augment(view.raw)) if streaming and augmentable(view.raw) else None
            del view  # a waiter keeps its body's bytes, nothing bigger
            if weight > self.cfg.max_sequences_per_request:
                raise ApiError(
                    400,
                    f"this request asks for {weight} sequences (prompts times max(n, best_of)); "
                    f"the limit is {self.cfg.max_sequences_per_request}",
                    param="n",
                    code="too_many_sequences",
                )
            if (
                not self.pool.serves(model)
                and self.pool.configured(model) is None
                and not await self._learned(model)
            ):
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
                raise model_not_found(model)
            headers = self.headers.of(request, rid)
            # As OpenAI's headers count it: the prompt, and max_tokens for every sequence.
            prompt_est = (hint.chars if hint is not None else len(body)) / CHARS_PER_TOKEN
            lease = await self.tenancy.admit(
                tenant, headers, (prompt_est, float((most or 0) * weight))
            )
            c = Completion(
                path,
                model,
                streaming,
                weight,
                body,
                priority,
                t0,
                chat,
                rid,
                headers,
                wants,
                tokens,
                hint,
                plus,
                tenant,
                lease,
            )
            resp, pool_label = await self.forwarder.forward(request, c)
            status = resp.status
            return resp
        except ApiError as e:
            status = e.status
            e.headers.setdefault("X-Request-ID", rid)
            if e.status == 429 and not isinstance(e, RateLimited):
                self.metrics.shed.labels(priority, e.code or "shed").inc()
            self.tenancy.rate_headers(e, lease)
            raise
        except asyncio.CancelledError:
            status = 499  # client closed the request (nginx's convention)
            if c is not None:
                pool_label = c.pool  # the pool of the leg it was on (none: not sent yet)
            raise
        finally:
            self.metrics.requests.labels(str(status), priority, pool_label).inc()
            if tenant is not None:
                self.tenancy.done(tenant, lease, status)

    def _hint(
        self,
        request: web.Request,
        raw: dict[str, Any],
        chat: bool,
        model: str,
        *,
        as_chat: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    ) -> RouteHint | None:
        """What a cache- or session-aware policy needs of this request (None for others).
        `as_chat`: `raw` is another API's conversation (the Responses API's, Anthropic's
        Messages), named in chat's messages (only for a policy that wants it)."""
        if not getattr(self.pool.policy, "wants_hint", False):
            return None
        if as_chat is not None:
            raw = as_chat(raw)
        return hint_of(
            raw,
            chat,
            model,
            block_chars=self.cfg.prefix_block_chars,
            session=request.headers.get(self.cfg.session_header) or None,
            user_header=request.headers.get("x-user-id") or None,
        )


def _json(data: bytes | None) -> object:
    """A JSON answer, None where it is not JSON."""
    try:
        return orjson.loads(data or b"")
    except orjson.JSONDecodeError:
        return None


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


def _wants(raw: dict[str, Any]) -> tuple[bool, bool, bool]:
    """What the client asked of the stream: (include_usage, continuous_usage_stats,
    return_token_ids). The relay strips what it did not ask for."""
    so = raw.get("stream_options")
    so = so if isinstance(so, dict) else {}
    usage = bool(lax_bool(so.get("include_usage")))
    return (
        usage,
        # vLLM: usage on every chunk only with include_usage too (the client saw usage on
        # every chunk where the engine sends none: a helper's diff of gateway and engine).
        usage and bool(lax_bool(so.get("continuous_usage_stats"))),
        bool(lax_bool(raw.get("return_token_ids"))),
    )
