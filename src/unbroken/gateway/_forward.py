"""A completion's attempts: leg 0 on an endpoint, tried elsewhere while nothing reached the
client, then either its whole answer (non-streaming, an error) or its stream (`_stream`).

Each attempt opens a leg through the one seam (`_legs.Legs.open`). A connect error, a 5xx or
the time limit moves the request to another endpoint, at most `max_attempts` and never the
same one twice; a 4xx is the request's fault and goes to the client as it is. A 5xx that a
second endpoint repeats byte for byte for the same body is taken as caused by the body: that
answer goes to the client and no third endpoint is tried. A non-streaming request has the
endpoint's learned answer limit per attempt (`_health.EndpointHealth.answer_limit`), all
attempts within `request_timeout_s` (then 504).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import orjson
from aiohttp import web

from unbroken.gateway._headers import Headers
from unbroken.gateway._health import LATE_FIRST, EndpointHealth
from unbroken.gateway._legs import Legs
from unbroken.gateway._pool import Endpoint, Pool
from unbroken.gateway._prefix import RouteHint
from unbroken.gateway._ratelimit import Lease
from unbroken.gateway._stream import RelayHost, StreamRelay
from unbroken.gateway._tenancy import Tenancy
from unbroken.gateway._upstream import Form, Retry
from unbroken.wire.errors import ApiError

if TYPE_CHECKING:
    from unbroken.config.spec import GatewaySettings
    from unbroken.config.tenants import TenantSpec
    from unbroken.gateway._metrics import GatewayMetrics

__all__ = ["Completion", "Forwarder"]

log = logging.getLogger("unbroken.gateway")


@dataclass(slots=True)
class Completion:
    """A completion request as the handler read it, all that its attempts need."""

    path: str  # the engine route: /v1/completions or /v1/chat/completions
    model: str
    streaming: bool
    weight: int  # slots: sequences the engine will run
    body: bytes  # the client's own body
    priority: str
    t0: float  # monotonic, when the request came in
    chat: bool
    rid: str
    headers: dict[str, str]  # what goes upstream (`_headers.Headers.of`)
    wants: tuple[bool, bool, bool] | None = None  # a stream's usage/ids asked (`_wants`)
    tokens: int | None = None  # non-streaming: its max_tokens (the answer limit scales)
    hint: RouteHint | None = None  # for cache- and session-aware policies
    augmented: bytes | None = None  # a stream's body asking for token counts and ids
    tenant: TenantSpec | None = None
    lease: Lease | None = None
    pool: str = "none"  # of the last leg opened: a request the client cancels counts there


class Forwarder:
    """The attempt loop of one process; `host` is what a stream's relay reaches (the proxy)."""

    def __init__(
        self,
        cfg: GatewaySettings,
        pool: Pool,
        legs: Legs,
        health: EndpointHealth,
        headers: Headers,
        tenancy: Tenancy,
        metrics: GatewayMetrics,
        host: RelayHost,
    ) -> None:
        self.cfg = cfg
        self.pool = pool
        self.legs = legs
        self.health = health
        self.headers = headers
        self.tenancy = tenancy
        self.metrics = metrics
        self.host = host

    async def forward(self, request: web.Request, c: Completion) -> tuple[web.StreamResponse, str]:
        """Send the request to an endpoint, trying others while nothing was sent to the
        client (module doc); the response and the pool that served it ("none")."""
        try:
            return await self._attempts(request, c)
        finally:
            self.headers.done(c.headers)

    async def _attempts(
        self, request: web.Request, c: Completion
    ) -> tuple[web.StreamResponse, str]:
        # A stream asks the engine for exact token counts and ids (see `_continuation.augment`);
        # an engine that refuses them (4xx) gets the client's own body, and is remembered.
        forms = [Form("plain", c.path, c.body)]
        if c.augmented is not None:
            forms.insert(0, Form("augmented", c.path, c.augmented, sticky=True))
        h = self.health
        tried: list[Endpoint] = []
        last: tuple[int, bytes] | None = None
        deadline = c.t0 + self.cfg.request_timeout_s  # non-streaming requests, all attempts

        def limit(ep: Endpoint) -> float:
            if c.streaming:
                return h.ttfb_limit(ep)
            return min(deadline - time.monotonic(), h.answer_limit(ep, c.tokens))

        answer = (
            None
            if c.streaming
            else h.answer_patience(c.model, c.priority, tried, deadline, c.tokens)
        )

        # A stream re-sent for a late step (`_health._watch_first`, which makes at most
        # LATE_MOVES a request) is moved, not failed: the endpoint is excluded from the next
        # pick only and the move is no attempt. Counted as failed attempts, two or three moves
        # in a row left no endpoint to try: 502 with every engine healthy.
        moved_from: Endpoint | None = None
        late_moves = 0
        attempt = 0  # attempts made that count against max_attempts
        while attempt < self.cfg.max_attempts:
            if attempt and not self.pool.could_serve(c.model, c.priority, tried):
                break
            attempt += 1
            try:
                leg = await self.legs.open(
                    c.model,
                    c.priority,
                    forms,
                    tried,
                    limit=limit,
                    streaming=c.streaming,
                    answer=answer,
                    deadline=None if c.streaming else deadline,
                    weight=c.weight,
                    size=len(c.body),
                    headers=c.headers,
                    hint=c.hint,
                    tenant=c.tenant,
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
            finally:
                if moved_from is not None:
                    tried.remove(moved_from)
                    moved_from = None
            ep, up = leg.ep, leg.up
            c.pool = ep.pool
            if up.status != 200 or not c.streaming:
                self.legs.release(ep, leg.n)
                data = leg.data or b""
                if c.lease is not None and up.status == 200:
                    self.tenancy.charge_body(c.lease, data)
                if up.status >= 500:
                    same = last is not None and (up.status, data) == last
                    last = (up.status, data)
                    if same:
                        # A second endpoint fails the same way on the same body: the body is
                        # the cause. Not this endpoint's fault, and no third try.
                        log.info("upstream %s: HTTP %d again for this body", ep.name, up.status)
                        break
                    kind = f"status_{up.status}"
                    h.upstream_failed(
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
                    headers=self.headers.response(c.headers, ep),
                ), ep.pool
            relay = StreamRelay(
                self.host,
                request,
                path=c.path,
                body=c.body,
                chat=c.chat,
                model=c.model,
                priority=c.priority,
                headers=c.headers,
                t0=c.t0,
                weight=c.weight,
                augmented=leg.kind == "augmented",
                wants=c.wants or (False, False, False),
                hint=c.hint,
            )
            relay.late_moves = late_moves
            self.tenancy.metering(relay, c.lease)
            try:
                return await relay.run(up, ep, leg.n), ep.pool
            except Retry as r:  # the relay has recorded its own failure, released its slots
                tried.append(ep)
                self.metrics.retries.labels(r.kind).inc()
                if r.kind == LATE_FIRST:
                    late_moves, moved_from = late_moves + 1, ep
                    attempt -= 1
            finally:
                if c.lease is not None:
                    self.tenancy.metered_end(relay)
        if last is not None and _is_openai_error(last[1]):
            return web.Response(
                status=last[0],
                body=last[1],
                content_type="application/json",
                headers={"X-Request-ID": c.rid},
            ), "none"
        raise ApiError(
            502,
            f"no endpoint could serve the request after {len(tried)} attempt(s)",
            code="upstream_unavailable",
        )


def _is_openai_error(body: bytes) -> bool:
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    return isinstance(obj, dict) and isinstance(obj.get("error"), dict)
