"""One client stream, relayed from one or more upstream legs.

Leg 0 is the original request. A leg whose first event does not come within the endpoint's
time-to-first-byte limit is cut; for leg 0 nothing has reached the client yet, so the request
is retried elsewhere. When a leg breaks after the client has received something
(connection reset, engine crash, no event for `stall_timeout_s`, an error event, a stream cut
short, or the drain deadline of its endpoint), the stream continues on another ready endpoint
(see `_continuation`) and the new leg is spliced in: same id and created time, no second role
chunk, usage added up, one finish. With greedy decoding the client receives exactly the text
an unbroken stream would have produced.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
from aiohttp import web

from unbroken.gateway._continuation import continuation_body, not_migratable
from unbroken.gateway._pool import Endpoint
from unbroken.gateway._relay import ClientGone, ClientSink, SlowClient, StreamTracker
from unbroken.wire.http import SSE_HEADERS
from unbroken.wire.sse import SSEDecoder, SSEEvent, encode_data, encode_json

if TYPE_CHECKING:
    from unbroken.gateway._proxy import Proxy

__all__ = ["UPSTREAM_ERRORS", "Retry", "StreamRelay"]

log = logging.getLogger("unbroken.gateway")

UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)


class Retry(Exception):
    """Leg 0 failed before the client received a byte: try another endpoint, invisibly."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


class StreamRelay:
    def __init__(
        self,
        proxy: Proxy,
        request: web.Request,
        *,
        path: str,
        body: bytes,
        chat: bool,
        model: str,
        priority: str,
        headers: dict[str, str],
        t0: float,
        weight: int = 1,
    ) -> None:
        self.p = proxy
        self.request = request
        self.path = path
        self.body = body
        self._raw: dict[str, Any] | None = None
        self.weight = weight
        self.chat = chat
        self.model = model
        self.priority = priority
        self.headers = headers
        self.t0 = t0
        self.tracker = StreamTracker(chat)
        self.resp: web.StreamResponse | None = None
        self.sink: ClientSink | None = None
        self.ep: Endpoint | None = None
        self.up: aiohttp.ClientResponse | None = None
        self.interrupted: str | None = None
        self.failed: list[Endpoint] = []
        self.migrations = 0
        self.base_tokens = 0
        self._last_token = 0.0
        self._itl: Any = None
        self._detail: str | None = None

    @property
    def raw(self) -> dict[str, Any]:
        """The request as a dict, parsed only when a migration needs it (a stream keeps its
        body's bytes, not a second, larger copy of it)."""
        if self._raw is None:
            self._raw = orjson.loads(self.body)
        return self._raw

    # -- called by the gateway ------------------------------------------------------------
    def interrupt(self, reason: str) -> None:
        """Cut the current leg now (drain deadline); the stream continues elsewhere."""
        if self.interrupted is None:
            self.interrupted = reason
            if self.up is not None:
                self.up.close()

    # -- the stream -----------------------------------------------------------------------
    async def run(
        self, up: aiohttp.ClientResponse, ep: Endpoint, n: int = 1
    ) -> web.StreamResponse:
        """Relay leg 0 (whose `n` slots on `ep` the caller has taken) and whatever follows.
        Raises Retry when leg 0 breaks before anything reached the client."""
        m = self.p.metrics
        try:
            reason = await self._leg(up, ep, n, rewrite=False)
            if reason is not None and self.sink is None:
                raise Retry(reason, f"stream from {ep.name} broke before its first event")
            while reason is not None:
                assert self.ep is not None
                self.failed.append(self.ep)
                why = not_migratable(self.raw, self.chat)
                if why is None and self.migrations >= self.p.cfg.max_migrations:
                    why = "migration_limit"
                if why is not None:
                    await self._give_up(reason, why)
                    return self._response()
                body = continuation_body(
                    self.raw, self.chat, self.tracker.text(0), self.tracker.token_events
                )
                self.migrations += 1
                m.migrated.labels(reason).inc()
                if body is None:  # every token was delivered; only the finish was lost
                    await self._send(self._finish_chunk())
                    await self._send(encode_data(b"[DONE]"))
                    break
                leg = await self._open(body)
                if leg is None:
                    await self._give_up(reason, "no_endpoint")
                    return self._response()
                log.info(
                    "stream %s: %s on %s, continued on %s after %d tokens",
                    self.tracker.id,
                    reason,
                    self.failed[-1].name,
                    leg[1].name,
                    self.tracker.token_events,
                )
                self.base_tokens = self.tracker.token_events
                self.interrupted = None
                self.tracker.error = None  # handled: this leg replaces the one that failed
                reason = await self._leg(*leg, rewrite=True)
            assert self.sink is not None
            await self.sink.finish()
        except ClientGone:
            m.client_disconnects.inc()
        except SlowClient:
            m.slow_clients.inc()
            log.warning("stream %s ended for a slow client", self.tracker.id)
            if self.sink is not None:
                self.sink.abort()
        except asyncio.CancelledError:
            m.client_disconnects.inc()
            if self.sink is not None:
                self.sink.abort()
            raise
        finally:
            if self.sink is not None:
                self.sink.detach()
                self.p.sinks.discard(self.sink)
        return self._response()

    def _response(self) -> web.StreamResponse:
        assert self.resp is not None
        return self.resp

    async def _open(
        self, body: dict[str, Any]
    ) -> tuple[aiohttp.ClientResponse, Endpoint, int] | None:
        """Slots on another endpoint and its upstream response, or None."""
        p = self.p
        assert p.session is not None
        data = orjson.dumps(body)
        for _ in range(p.cfg.max_attempts):
            if not p.pool.could_serve(self.model, self.priority, self.failed):
                return None
            ep, n, _waited = await p.admission.acquire(
                self.model, self.priority, self.failed, weight=self.weight
            )
            tmo = asyncio.timeout(p.ttfb_limit(ep))
            try:
                async with tmo:
                    up = await p.session.post(
                        ep.url + self.path, data=data, headers=p.upstream_headers(self.headers, ep)
                    )
            except UPSTREAM_ERRORS as e:
                kind = "ttfb" if tmo.expired() else "connect"
                p.upstream_failed(ep, kind, f"{type(e).__name__}: {e}")
                self.failed.append(ep)
                p.release(ep, n)
                continue
            if up.status != 200:
                up.close()
                p.upstream_failed(ep, f"status_{up.status}", "continuation refused")
                self.failed.append(ep)
                p.release(ep, n)
                continue
            return up, ep, n
        return None

    async def _leg(
        self, up: aiohttp.ClientResponse, ep: Endpoint, n: int, *, rewrite: bool
    ) -> str | None:
        """One leg, and the one place its failure is put on the endpoint's record (a break
        we caused ourselves, the drain deadline, is not the endpoint's failure)."""
        self._detail = None
        reason = await self._pump(up, ep, n, rewrite=rewrite)
        if reason is not None and reason != self.interrupted:
            self.p.upstream_failed(ep, reason, self._detail or f"stream {reason}")
        return reason

    async def _pump(
        self, up: aiohttp.ClientResponse, ep: Endpoint, n: int, *, rewrite: bool
    ) -> str | None:
        """Pump one upstream leg into the client. None: the stream is complete; otherwise
        why the leg broke. Releases the leg's slots."""
        self.up, self.ep = up, ep
        ep.relays.add(self)
        stall = self.p.cfg.stall_timeout_s
        loop = asyncio.get_running_loop()
        dec = SSEDecoder()
        finished_read = False
        started = loop.time()
        first = True
        try:
            # Until the first event: the endpoint's time-to-first-byte limit.
            async with asyncio.timeout_at(started + self.p.ttfb_limit(ep)) as tmo:
                armed = 0.0
                async for chunk in up.content.iter_any():
                    events = dec.feed(chunk)
                    if not events:
                        continue
                    now = loop.time()
                    if first:
                        first = False
                        self.p.observe_ttfb(ep, now - started)
                    if now - armed > stall / 4:  # re-arm sparingly: a timer per chunk costs
                        tmo.reschedule(now + stall)
                        armed = now
                    verdict = await self._take(events, rewrite)
                    if verdict is not None:
                        return None if verdict == "done" else verdict
                finished_read = True
                tail = dec.flush()
                if tail:
                    verdict = await self._take(tail, rewrite)
                    if verdict is not None:
                        return None if verdict == "done" else verdict
            if self.interrupted:
                return self.interrupted
            if self.tracker.finished:  # finish seen, [DONE] lost: complete it
                await self._send(encode_data(b"[DONE]"))
                return None
            return "truncated"
        except TimeoutError:
            return self.interrupted or ("ttfb" if first else "stall")
        except UPSTREAM_ERRORS as e:
            self._detail = f"{type(e).__name__}: {e}"
            return self.interrupted or "reset"
        finally:
            ep.relays.discard(self)
            self.up = None
            if finished_read:
                up.release()
            else:
                up.close()  # the engine sees the disconnect and frees the slot
            self.p.release(ep, n)

    async def _take(self, events: list[SSEEvent], rewrite: bool) -> str | None:
        """Forward a batch of events; "done" at a proper end, a reason at a break."""
        tracker = self.tracker
        out: list[bytes] = []
        verdict: str | None = None
        tokens = 0
        for ev in events:
            if ev.data is None:
                out.append(ev.raw)
                continue
            if ev.is_done:
                if tracker.finished:
                    tracker.done = True
                    out.append(ev.raw)
                    verdict = "done"
                else:
                    verdict = "truncated"
                break
            try:
                obj = orjson.loads(ev.data)
            except orjson.JSONDecodeError:
                out.append(ev.raw)
                continue
            if not isinstance(obj, dict):
                out.append(ev.raw)
                continue
            if "error" in obj:
                tracker.observe_obj(obj)
                verdict = "error_event"
                break
            raw = ev.raw
            if rewrite:
                raw = self._rewrite(obj)
                if raw is None:
                    continue
            tokens += tracker.observe_obj(obj)
            out.append(raw)
        if out:
            if tokens:
                now = time.monotonic()
                if self._last_token == 0.0:
                    ttft, self._itl = self.p.metrics.for_pool(self.ep.pool if self.ep else "none")
                    ttft.observe(now - self.t0)
                else:
                    self._itl.observe(now - self._last_token)
                for _ in range(tokens - 1):
                    self._itl.observe(0.0)
                self._last_token = now
            await self._send(b"".join(out))
        return verdict

    async def _send(self, data: bytes) -> None:
        if self.sink is None:
            assert self.ep is not None
            self.resp = web.StreamResponse(
                headers={**SSE_HEADERS, **self.p.response_headers(self.headers, self.ep)}
            )
            await self.resp.prepare(self.request)
            self.sink = ClientSink(
                self.resp,
                self.request.transport,
                self.p.cfg.stream_buffer_bytes,
                self.p.buffer_budget,
            )
            self.p.sinks.add(self.sink)
        await self.sink.send(data)

    def _rewrite(self, obj: dict[str, Any]) -> bytes | None:
        """An event of a continuation leg, as the original stream would have sent it."""
        t = self.tracker
        if t.id is not None:
            obj["id"] = t.id
            obj["created"] = t.created
        choices = obj.get("choices")
        if self.chat and choices:
            keep = []
            for ch in choices:
                d = ch.get("delta")
                if isinstance(d, dict) and "role" in d:
                    del d["role"]
                    if (
                        not d.get("content")
                        and not ch.get("finish_reason")
                        and not d.get("tool_calls")
                    ):
                        continue
                keep.append(ch)
            if not keep and not obj.get("usage"):
                return None
            obj["choices"] = keep
        u = obj.get("usage")
        if isinstance(u, dict) and "prompt_tokens" in u:
            b = self.base_tokens
            obj["usage"] = {
                **u,
                "prompt_tokens": u["prompt_tokens"] - b,
                "completion_tokens": u.get("completion_tokens", 0) + b,
            }
        return encode_json(obj)

    def _finish_chunk(self) -> bytes:
        t = self.tracker
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "delta": {},
                "logprobs": None,
                "finish_reason": "length",
            }
            kind = "chat.completion.chunk"
        else:
            choice = {
                "index": 0,
                "text": "",
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
            }
            kind = "text_completion"
        t.finish[0] = "length"
        return encode_json(
            {
                "id": t.id,
                "object": kind,
                "created": t.created,
                "model": t.model,
                "choices": [choice],
            }
        )

    async def _give_up(self, reason: str, why: str) -> None:
        """End the stream explicitly: an error event the client can see, then [DONE]."""
        m = self.p.metrics
        pool = self.failed[-1].pool if self.failed else "none"
        m.dropped.labels(pool, reason).inc()
        m.unmigratable.labels(why).inc()
        log.warning(
            "stream %s broke (%s) and cannot be continued (%s)", self.tracker.id, reason, why
        )
        err = self.tracker.error or {
            "message": f"the upstream stream broke ({reason}) and cannot be continued "
            f"elsewhere ({why})",
            "type": "upstream_error",
            "param": None,
            "code": "stream_broken",
        }
        await self._send(encode_json({"error": err}))
        await self._send(encode_data(b"[DONE]"))
        assert self.sink is not None
        await self.sink.finish()
