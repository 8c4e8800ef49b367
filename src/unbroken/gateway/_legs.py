"""The one way upstream: admission picks an endpoint and takes its slots, then the request
goes to it, and a failure is put on the endpoint's record.

Every upstream request of a completion comes through `Legs.open`: leg 0 of a stream or a
non-streaming request (`_forward`), and every continuation of a stream (`_stream`). The
pass-through routes, relayed by aiohttp's client byte for byte, take their slots through the
same `admit` and give them back through `release`. What `open` is given is what it needs: the
pool, admission, the endpoints' health records (`_health`), the header rules and the HTTP
client; not the proxy.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from unbroken.gateway._admission import Admission
from unbroken.gateway._headers import Headers
from unbroken.gateway._health import EndpointHealth
from unbroken.gateway._pool import Endpoint, Pool
from unbroken.gateway._prefix import RouteHint
from unbroken.gateway._upstream import UPSTREAM_ERRORS, Form, Leg, Retry, Upstream, UpstreamResponse

if TYPE_CHECKING:
    from unbroken.config.tenants import TenantSpec
    from unbroken.gateway._metrics import GatewayMetrics

__all__ = ["Legs"]

log = logging.getLogger("unbroken.gateway")


class Legs:
    """Opening upstream legs for one process (`on_release`: the gateway's hook after slots
    come back, which removes a drained endpoint once it is empty)."""

    def __init__(
        self,
        pool: Pool,
        admission: Admission,
        health: EndpointHealth,
        headers: Headers,
        upstream: Upstream,
        metrics: GatewayMetrics,
        on_release: Callable[[Endpoint], None],
    ) -> None:
        self.pool = pool
        self.admission = admission
        self.health = health
        self.headers = headers
        self.upstream = upstream
        self.metrics = metrics
        self._on_release = on_release

    async def admit(
        self,
        model: str,
        priority: str,
        exclude: list[Endpoint],
        *,
        weight: int = 1,
        size: int = 0,
        hint: RouteHint | None = None,
        tenant: TenantSpec | None = None,
        leg: bool = True,
    ) -> tuple[Endpoint, int]:
        """Wait for slots on an endpoint not in `exclude` (admission: pick, fair queue); the
        endpoint and how many slots were taken. `leg`: a completion's leg, whose wait the
        queue-wait histogram counts (the routing policy learns it in `open`, once it is
        sent); a pass-through request is not counted (as before this seam)."""
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
        if leg and waited:
            self.metrics.queue_wait.labels(priority).observe(waited)
        if tenant is not None:
            self.metrics.tenant_queue_wait.labels(tenant.name).observe(waited)
        return ep, n

    def release(self, ep: Endpoint, n: int = 1) -> None:
        """Give `n` slots on `ep` back."""
        self.admission.release(ep, n)
        self._on_release(ep)

    async def open(
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
        h = self.health
        ep, n = await self.admit(
            model, priority, exclude, weight=weight, size=size, hint=hint, tenant=tenant
        )
        learnt = False

        def learn() -> None:
            # The policy learns the leg once its request is on the socket: recording a long
            # prompt's blocks in the prefix index (~0.1-0.4 ms) then overlaps the engine's
            # work instead of delaying its start. Once per leg (a retried send, a refused
            # form), and on a failure before any send too.
            nonlocal learnt
            if not learnt:
                learnt = True
                self.pool.admitted(ep, model, priority, hint)

        hdrs = self.headers.upstream(headers, ep)
        refused = self.health.refuses(ep)
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
                    stop_waiting = h.patience(tmo, h.first_byte_patience(ep, start))
                elif answer is not None:
                    stop_waiting = h.patience(tmo, answer(ep))
                balked: str | None = None  # a sticky form this endpoint answered 4xx
                for i, form in enumerate(todo):
                    up = await self.upstream.request(ep.url, form.path, form.body, hdrs, sent=learn)
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
                            balked = form.kind
                        continue
                    if balked is not None and up.status < 400:
                        # Refused the sticky form, took a later one: not asked for it again.
                        # Only then: a request the engine refuses in every form (a bad
                        # `max_tokens`) said nothing about the form, and marked the endpoint
                        # for good (a helper's review).
                        self.health.refused(ep, balked)
                    if up.status < 500:
                        h.upstream_ok(ep)
                    if up.status == 200 and not streaming and data is not None:
                        h.observe_answer(ep, time.monotonic() - sent, data, weight)
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
            h.upstream_failed(ep, kind, detail)
            exclude.append(ep)
            self.release(ep, n)
            raise Retry(kind, detail) from None
        except BaseException:
            if up is not None:
                up.close()
            self.release(ep, n)
            raise
        finally:
            learn()
            if stop_waiting is not None:
                stop_waiting()
        raise AssertionError("unreachable: the last form always returns")
