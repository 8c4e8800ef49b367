"""Engine routes whose answer depends on which replica is asked: a stored response of the
Responses API (it lives on the engine that made it), and runtime LoRA adapters (each engine
loads its own). Also what the pass-through relay reads of a Responses stream: its id (the
replica that holds it) and its usage (the tenant's token limits).

vllm-router forwards these to one worker like any other route, so a follow-up turn
(`previous_response_id`) or a `GET /v1/responses/{id}` lands on a replica that never saw the
response (vLLM: 404), and an adapter is loaded on one replica of several.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
from aiohttp import web

from unbroken.gateway._headers import request_id
from unbroken.gateway._pool import Endpoint, Pool, State
from unbroken.gateway._upstream import UPSTREAM_ERRORS
from unbroken.wire.errors import ApiError, model_not_found
from unbroken.wire.openai import usage_of
from unbroken.wire.sse import SSEDecoder

if TYPE_CHECKING:
    from unbroken.config.spec import GatewaySettings
    from unbroken.config.tenants import TenantSpec
    from unbroken.gateway._headers import Headers
    from unbroken.gateway._ratelimit import Lease
    from unbroken.gateway._tenancy import Tenancy

__all__ = ["LORA_ROUTES", "RESPONSE_ROUTES", "EngineRoutes", "ResponseHomes", "StreamScan"]

log = logging.getLogger("unbroken.gateway")

# vLLM's routes of a stored response, and of runtime adapters (`--enable-lora` with
# VLLM_ALLOW_RUNTIME_LORA_UPDATING).
RESPONSE_ROUTES = (
    ("GET", "/v1/responses/{response_id}"),
    ("POST", "/v1/responses/{response_id}/cancel"),
)
LORA_ROUTES = (("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter"))

_CALL_TIMEOUT = aiohttp.ClientTimeout(total=60.0)  # loading an adapter reads its weights


class ResponseHomes:
    """Which endpoint made each recent stored response (response id → endpoint name): a
    follow-up asks that replica first. Bounded (least recently used out); per process, so
    a follow-up on another worker or gateway replica finds it by asking each engine in
    turn (the engines answer 404 for what they do not hold)."""

    __slots__ = ("_homes", "limit")

    def __init__(self, limit: int = 65_536) -> None:
        self._homes: OrderedDict[str, str] = OrderedDict()
        self.limit = limit

    def note(self, response_id: str, ep: Endpoint) -> None:
        self._homes[response_id] = ep.name
        self._homes.move_to_end(response_id)
        while len(self._homes) > self.limit:
            self._homes.popitem(last=False)

    def get(self, response_id: str) -> str | None:
        name = self._homes.get(response_id)
        if name is not None:
            self._homes.move_to_end(response_id)
        return name

    def note_answer(self, obj: object, ep: Endpoint) -> None:
        """A whole Responses answer (parsed): note its id."""
        rid = obj.get("id") if isinstance(obj, dict) else None
        if isinstance(rid, str):
            self.note(rid, ep)


class StreamScan:
    """What a relayed pass-through stream tells the gateway: its usage (charged to the
    tenant as it comes; the last report is the total) and, for the Responses API, the
    response's id. Only events that mention either are decoded."""

    __slots__ = ("_charge", "_dec", "_ep", "_homes", "_lease")

    def __init__(
        self,
        ep: Endpoint,
        homes: ResponseHomes | None,
        lease: Lease | None,
        charge: Callable[[Lease, int | None, int | None], None],
    ) -> None:
        self._dec = SSEDecoder()
        self._ep, self._homes, self._lease, self._charge = ep, homes, lease, charge

    def feed(self, chunk: bytes) -> None:
        try:
            events = self._dec.feed(chunk)
        except ValueError:  # an event past the decoder's bound: nothing to read in it
            self._dec = SSEDecoder()
            return
        for ev in events:
            data = ev.data
            if not data or (b'"usage"' not in data and b'"response"' not in data):
                continue
            try:
                obj = orjson.loads(data)
            except orjson.JSONDecodeError:
                continue
            if self._homes is not None and isinstance(obj, dict):
                r = obj.get("response")
                if isinstance(r, dict) and isinstance(r.get("id"), str):
                    self._homes.note(r["id"], self._ep)
            if self._lease is not None and (u := usage_of(obj)) is not None:
                self._charge(self._lease, *u)


class EngineRoutes:
    """The handlers of `RESPONSE_ROUTES` and `LORA_ROUTES`; a part of `Handlers`."""

    cfg: GatewaySettings
    pool: Pool
    session: aiohttp.ClientSession | None
    headers: Headers
    tenancy: Tenancy
    homes: ResponseHomes
    read_models: Callable[[], Awaitable[None]] | None
    # The pass-through relay (`Handlers._pass_stream`): a stored background response
    # streamed again is relayed as any pass-through stream.
    _pass_stream: Callable[..., Awaitable[web.StreamResponse]]

    def _holders(self, home: str | None) -> list[Endpoint]:
        """The endpoints that may hold a stored response, its home first: ready or draining
        (a draining replica still answers for what it holds), healthy."""
        eps = [
            e
            for e in self.pool.endpoints.values()
            if e.state in (State.READY, State.DRAINING) and e.healthy
        ]
        eps.sort(key=lambda e: e.name != home)
        return eps

    async def response_by_id(self, request: web.Request) -> web.StreamResponse:
        """`GET /v1/responses/{id}` and its cancel: asked of the replica that made the
        response, else of each in turn until one does not answer 404."""
        if self.tenancy.tenants is not None:
            self.tenancy.resolve(request)
        assert self.session is not None
        rid = request.match_info["response_id"]
        base = {"X-Request-ID": request_id(request)}
        base.update(
            (k, v) for k, v in request.headers.items() if k.lower() in ("accept", "content-type")
        )
        body = await request.read()
        last: web.Response | None = None
        for ep in self._holders(self.homes.get(rid)):
            try:
                async with self.session.request(
                    request.method,
                    ep.url + request.rel_url.raw_path_qs,
                    data=body or None,
                    headers=self.headers.upstream(base, ep),
                    timeout=_CALL_TIMEOUT,
                ) as up:
                    if up.content_type == "text/event-stream" and up.status == 200:
                        return await self._pass_stream(request, up, ep, base)
                    answer = web.Response(
                        status=up.status,
                        body=await up.read(),
                        content_type=up.content_type,
                        headers=self.headers.response(base, ep),
                    )
            except UPSTREAM_ERRORS as e:
                log.info("%s %s on %s: %s", request.method, request.path, ep.name, e)
                continue
            if answer.status != 404:
                if answer.status == 200:
                    self.homes.note(rid, ep)
                return answer
            last = answer
        if last is not None:
            return last
        raise ApiError(404, f"Response with id '{rid}' not found.", type="invalid_request_error")

    async def lora_adapter(self, request: web.Request) -> web.Response:
        """`POST /v1/load_lora_adapter` / `unload`: applied on every ready replica of the
        base model (the body's `model`, needed only when several are served), then the
        engines' models read again so the adapter is routable at once. 200 when every
        replica took it; otherwise the first refusal, as its engine gave it. A replica that
        joins later does not have it: adapters meant to stay belong in the spec's
        `adapters:` (docs/gateway.md).

        What is served changes for every client, so with tenants only a tenant with
        `manage_adapters` may call it (403 otherwise), and the call is one of its requests
        (its limits, its metrics). A load may not take a name the gateway serves or the spec
        declares as something else (a base model, an alias, another base's adapter): 400."""
        tenant: TenantSpec | None = None
        lease: Lease | None = None
        status = 500
        try:
            if self.tenancy.tenants is not None:
                tenant = self.tenancy.resolve(request)
                if not tenant.manage_adapters:
                    raise ApiError(
                        403,
                        "This API key may not load or unload LoRA adapters: that changes what "
                        "every client is served, which needs a tenant with "
                        "`manage_adapters: true` in the gateway's tenants.",
                        code="permission_denied",
                    )
            assert self.session is not None
            body = await request.read()
            try:
                obj = orjson.loads(body)
            except orjson.JSONDecodeError:
                raise ApiError(400, "the body is not valid JSON", code="invalid_json") from None
            if not isinstance(obj, dict):
                raise ApiError(400, "the body must be a JSON object", code="invalid_body")
            targets = self._lora_targets(obj, load=request.path == "/v1/load_lora_adapter")
            # One of the tenant's requests, as any other (429 over a limit); its headers go
            # on the answer below.
            lease = await self.tenancy.admit(tenant, None)
            resp = await self._apply(request, targets, orjson.dumps(obj))
            status = resp.status
            if lease is not None and lease.headers:
                resp.headers.update(lease.headers)
            return resp
        except ApiError as e:
            status = e.status
            self.tenancy.rate_headers(e, lease)
            raise
        except asyncio.CancelledError:
            status = 499
            raise
        finally:
            self.tenancy.done(tenant, lease, status)

    def _lora_targets(self, obj: dict[str, Any], *, load: bool) -> list[Endpoint]:
        """The ready replicas of the adapter's base (the body's `model`, popped from it):
        400 when it is needed and missing, or when a load would take another thing's name;
        404 for an unknown base; 503 when none is ready."""
        base_model = obj.pop("model", None)
        ready = [e for e in self.pool.endpoints.values() if e.state == State.READY and e.healthy]
        groups = {frozenset(e.models - e.adapters.keys()) for e in ready}
        if base_model is None:
            if len(groups) > 1:
                names = ", ".join(sorted(self._base_name(g) for g in groups if g))
                raise ApiError(
                    400,
                    f"several base models are served ({names}): name the adapter's base in `model`",
                    param="model",
                    code="model_required",
                )
        elif not isinstance(base_model, str) or not any(base_model in g for g in groups):
            raise model_not_found(base_model)
        targets = [
            e for e in ready if base_model is None or base_model in e.models - e.adapters.keys()
        ]
        if not targets:
            raise ApiError(
                503, "no endpoint is ready yet", code="no_endpoint", headers={"Retry-After": "1"}
            )
        name = obj.get("lora_name")
        if load and isinstance(name, str):
            bases = frozenset[str]().union(*(e.models - e.adapters.keys() for e in targets))
            if (taken := self._taken(name, bases)) is not None:
                raise ApiError(
                    400,
                    f"The adapter name `{name}` is taken: it is {taken}, and a request for "
                    f"`{name}` must keep reaching it. Load the adapter under another name.",
                    param="lora_name",
                    code="adapter_name_taken",
                )
        return targets

    async def _apply(
        self, request: web.Request, targets: list[Endpoint], data: bytes
    ) -> web.Response:
        """The adapter call on every target, then the engines' models read again."""
        headers = {"Content-Type": "application/json"}
        answers = await asyncio.gather(
            *(self._call(request.method, e, request.path, data, headers) for e in targets)
        )
        if self.read_models is not None:
            try:
                await asyncio.wait_for(self.read_models(), 5.0)
            except (TimeoutError, *UPSTREAM_ERRORS):
                pass
        failed = [(e, a) for e, a in zip(targets, answers, strict=True) if a.status != 200]
        if failed:
            took = len(targets) - len(failed)
            log.warning(
                "%s: %d of %d replicas took it; %s answered %d",
                request.path,
                took,
                len(targets),
                failed[0][0].name,
                failed[0][1].status,
            )
            return failed[0][1]
        return answers[0]

    def _spec_bases(self) -> list[str]:
        """The base model of each pool of the spec (its first name; the others are its
        aliases and adapters)."""
        return [names[0] for names in self.pool.pool_models.values() if names]

    def _base_name(self, group: frozenset[str]) -> str:
        """A group of names one engine serves (its model and aliases) by its model's name,
        as /v1/models names it (an adapter's `parent`): the spec's model, else the parent
        its engines' adapters give, else every name of the group."""
        for b in self._spec_bases():
            if b in group:
                return b
        parents = {p for e in self.pool.endpoints.values() for p in e.adapters.values()}
        if len(found := parents & group) == 1:
            return next(iter(found))
        return " / ".join(sorted(group))

    def _taken(self, name: str, bases: frozenset[str]) -> str | None:
        """Why an adapter `name` loaded on the base `bases` (its model and aliases) would
        take another thing's name, or None: a base model or alias an engine serves or the
        spec declares, or an adapter of another base (live, or declared in the spec). An
        adapter of the same base is the engine's to answer (already loaded, or a reload of
        a spec adapter that was unloaded)."""
        cards = self.cfg.adapter_cards
        for e in self.pool.endpoints.values():
            if e.state == State.GONE:
                continue
            if name in e.models and name not in e.adapters:
                return "a model the gateway serves"
            parent = e.adapters.get(name)
            if parent is not None and parent not in bases:
                return f"an adapter of `{parent}`"
        for pool, names in self.pool.pool_models.items():
            if name in names and name not in cards:
                return f"a model the spec declares (pool {pool})"
        card = cards.get(name)
        if card is not None and card.get("parent") not in bases:
            return f"an adapter of `{card.get('parent')}` in the spec"
        return None

    async def _call(
        self, method: str, ep: Endpoint, path: str, data: bytes, headers: dict[str, str]
    ) -> web.Response:
        assert self.session is not None
        try:
            async with self.session.request(
                method,
                ep.url + path,
                data=data,
                headers=self.headers.upstream(headers, ep),
                timeout=_CALL_TIMEOUT,
            ) as up:
                return web.Response(
                    status=up.status, body=await up.read(), content_type=up.content_type
                )
        except UPSTREAM_ERRORS as e:
            return ApiError(
                502, f"{ep.name}: {type(e).__name__}: {e}", code="upstream_unavailable"
            ).response()
