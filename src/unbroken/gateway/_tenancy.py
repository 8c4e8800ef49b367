"""Who a request is and what it may use: its priority, its tenant, and the tenant's limits.

Without tenants a request's priority comes from the priority header, else `priority_keys`
(the API key), else the default. With tenants (issue 25) the API key names the tenant (401
for an unknown one) and the tenant's priority is a ceiling the header may only lower; its
limits are checked before admission (`admit`: 429 over one), its x-ratelimit headers go on
every answer, and its tokens are charged as they come (`metering`, every METER_S, for live
streams) and at the end (`charge_body` for a whole answer).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import orjson
from aiohttp import web

from unbroken.gateway._admission import PRIORITIES
from unbroken.gateway._headers import Headers
from unbroken.gateway._messages import LeaseState
from unbroken.gateway._ratelimit import Lease, Limiter, RateLimited
from unbroken.gateway._tenants import NONE, Tenants, priority_for
from unbroken.wire.errors import ApiError, model_not_found
from unbroken.wire.openai import usage_of

if TYPE_CHECKING:
    from unbroken.config.spec import GatewaySettings
    from unbroken.config.tenants import TenantSpec
    from unbroken.gateway._metrics import GatewayMetrics
    from unbroken.gateway._stream import StreamRelay

__all__ = ["METER_S", "Tenancy"]

# Live streams' tokens are charged to their tenant this often (and once more at their end).
METER_S = 0.25


def authorization(request: web.Request) -> str | None:
    """The client's key as an `Authorization` value: its own, else the key of an `api-key`
    header (Azure OpenAI's clients) or `x-api-key` (Anthropic-style clients), as LiteLLM
    takes them. Neither goes upstream (`_headers.HOP`)."""
    auth = request.headers.get("Authorization")
    if auth is None:
        key = request.headers.get("api-key") or request.headers.get("x-api-key")
        if key:
            return f"Bearer {key.strip()}"
    return auth


class Tenancy:
    """Identification and the tenants' limits of one process (`tenants`, `limiter`: set by
    the gateway when `tenants` is configured)."""

    def __init__(self, cfg: GatewaySettings, headers: Headers, metrics: GatewayMetrics) -> None:
        self.cfg = cfg
        self.headers = headers
        self.metrics = metrics
        self.tenants: Tenants | None = None
        self.limiter: Limiter | None = None
        # The live streams whose tokens are charged as they come.
        self._metered: dict[StreamRelay, Lease] = {}
        self._meter: asyncio.Task[None] | None = None

    def priority(self, request: web.Request) -> str:
        value = request.headers.get(self.cfg.priority_header)
        if value is None and self.cfg.priority_keys:
            auth = authorization(request) or ""
            if auth.startswith("Bearer "):
                value = self.cfg.priority_keys.get(auth[7:])
        if value is None:
            return self.cfg.default_priority
        return self._asked(value)

    def identify(self, request: web.Request) -> tuple[str, TenantSpec | None]:
        """The request's priority and tenant. With tenants, the key names the tenant (or
        401) and the tenant's priority is a ceiling the priority header may only lower;
        without, the header, else `priority_keys`, else the default, as before tenants."""
        if self.tenants is None:
            return self.priority(request), None
        tenant = self.resolve(request)
        asked = request.headers.get(self.cfg.priority_header)
        return priority_for(tenant, None if asked is None else self._asked(asked)), tenant

    def resolve(self, request: web.Request) -> TenantSpec:
        """The tenant the request's key names (401 in OpenAI's format when none does and
        there is no `anonymous` tenant, counted). Only with tenants."""
        assert self.tenants is not None
        try:
            return self.tenants.resolve(authorization(request))
        except ApiError:
            self.metrics.tenant_rejections.labels(NONE, "invalid_api_key").inc()
            self.metrics.tenant_requests.labels(NONE, "401").inc()
            raise

    @staticmethod
    def may_use(tenant: TenantSpec | None, model: str) -> bool:
        """Whether `tenant` may use `model` (its `models`, when it names any)."""
        return tenant is None or tenant.models is None or model in tenant.models

    def check_model(self, tenant: TenantSpec | None, model: str) -> None:
        """404 for a model the tenant may not use, the very answer an unknown model gets
        (a tenant learns nothing of what others are served)."""
        if not self.may_use(tenant, model):
            raise model_not_found(model)

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

    async def admit(
        self,
        tenant: TenantSpec | None,
        headers: dict[str, str] | None,
        estimate: tuple[float, float] = (0.0, 0.0),
    ) -> Lease | None:
        """Take the request from its tenant's limits (429 when over one); its x-ratelimit
        headers go on every response made from `headers` (`_headers.Headers.response`;
        None: the caller puts the lease's own on its answer), its token headers net of
        `estimate` (its prompt and completion tokens, guessed)."""
        if tenant is None or self.limiter is None:
            return None
        try:
            lease = await self.limiter.admit(tenant.name, estimate)
        except RateLimited as e:
            self.metrics.tenant_rejections.labels(tenant.name, e.reason).inc()
            raise
        if lease.headers and headers is not None:
            self.headers.rate[id(headers)] = lease.headers
        return lease

    def rate_headers(self, e: ApiError, lease: Lease | None) -> None:
        if lease is not None and lease.headers:
            for k, v in lease.headers.items():
                e.headers.setdefault(k, v)

    def charge(self, lease: Lease, prompt: int | None, completion: int | None) -> None:
        """Charge a request's token totals so far (what is new of them) to its tenant."""
        assert self.limiter is not None
        p0, c0 = lease.prompt, lease.completion
        self.limiter.charge(lease, prompt, completion)
        if lease.prompt > p0:
            self.metrics.tenant_tokens.labels(lease.tenant, "prompt").inc(lease.prompt - p0)
        if lease.completion > c0:
            self.metrics.tenant_tokens.labels(lease.tenant, "completion").inc(lease.completion - c0)

    def charge_body(self, lease: Lease, data: bytes | None) -> None:
        """A whole answer's usage (non-streaming: one body, never continued); the Responses
        API's names for it too (`input_tokens`, `output_tokens`)."""
        if not data:
            return
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            return
        self.charge_answer(lease, obj)

    def charge_answer(self, lease: Lease, obj: object) -> None:
        """`charge_body` of an answer already parsed."""
        u = usage_of(obj)
        if u is not None:
            self.charge(lease, *u)

    def done(self, tenant: TenantSpec | None, lease: Lease | None, status: int) -> None:
        if tenant is None:
            return
        self.metrics.tenant_requests.labels(tenant.name, str(status)).inc()
        if lease is not None and self.limiter is not None:
            self.limiter.finish(lease)

    def metering(self, relay: StreamRelay, lease: Lease | None) -> None:
        """Charge a live stream's tokens as they come (every METER_S), not only at its end,
        so a tenant's token limits see long streams while they run."""
        if lease is None:
            return
        self._metered[relay] = lease
        if self._meter is None or self._meter.done():
            self._meter = asyncio.get_running_loop().create_task(self._meter_loop())

    def lease_state(self, relay: StreamRelay) -> LeaseState | None:
        """A stream about to be handed to another worker: its tenant and what was charged,
        its tokens counted up to now (the receiving worker charges the rest)."""
        lease = self._metered.get(relay)
        if lease is None or self.limiter is None:
            return None
        self.charge(lease, relay.x.prompt_tokens, relay.x.sent)
        return LeaseState(
            tenant=lease.tenant,
            prompt=lease.prompt,
            completion=lease.completion,
            remote=lease.remote,
        )

    def adopted(self, relay: StreamRelay, state: LeaseState | None) -> Lease | None:
        """A handed-over stream's tenant count taken over here (`lease_state`)."""
        if state is None or self.limiter is None:
            return None
        lease = self.limiter.adopt(
            state["tenant"], state["prompt"], state["completion"], state["remote"]
        )
        if lease is not None:
            self.metering(relay, lease)
        return lease

    def adopted_end(self, relay: StreamRelay, lease: Lease | None) -> None:
        if lease is None or self.limiter is None:
            return
        self.metered_end(relay)
        self.limiter.finish(lease)

    def metered_end(self, relay: StreamRelay) -> None:
        lease = self._metered.pop(relay, None)
        if lease is not None:
            self.charge(lease, relay.x.prompt_tokens, relay.x.sent)

    async def _meter_loop(self) -> None:
        while self._metered:
            await asyncio.sleep(METER_S)
            for relay, lease in list(self._metered.items()):
                self.charge(lease, relay.x.prompt_tokens, relay.x.sent)
