"""The headers of a request on its way up, and of its answer on the way back.

What goes upstream is rebuilt, not copied: hop-by-hop headers, the client's credentials
(`Authorization`, `api-key`, `x-api-key`, `Cookie`) and `Content-Encoding` (aiohttp already
decoded the body) are dropped, `Content-Type` is always `application/json`, the pool's own
API key is sent when one is configured, and `X-Request-ID` is the client's (when it is a
sane token) or a new one, echoed to the client either way, with the serving endpoint's name
(`endpoint_header`) and the tenant's x-ratelimit headers (`rate`, filled by `_tenancy`).
"""

from __future__ import annotations

import os
import re
import uuid
from typing import TYPE_CHECKING

from aiohttp import web

from unbroken.gateway._pool import Endpoint

if TYPE_CHECKING:
    from unbroken.config.spec import GatewaySettings

__all__ = ["HOP", "Headers", "request_id"]

HOP = {
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
    "api-key",
    "x-api-key",
    "cookie",
    "content-encoding",
    "content-type",
    "x-request-id",
    # The gateway has read the whole body already; an engine's interim answer is not wanted.
    "expect",
}
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,128}$")


def request_id(request: web.Request) -> str:
    """The client's X-Request-ID when it is 1..128 sane characters, else a new one."""
    rid = request.headers.get("X-Request-ID", "")
    return rid if _REQUEST_ID.match(rid) else uuid.uuid4().hex


class Headers:
    """The header rules of one process (its settings and the pools' keys)."""

    def __init__(self, cfg: GatewaySettings) -> None:
        self.endpoint_header = cfg.endpoint_header
        self._skip = HOP | {cfg.priority_header.lower()}
        self.pool_keys = {
            pool: key for pool, env in cfg.upstream_key_env.items() if (key := os.environ.get(env))
        }
        # `*`: every pool without a key of its own (`--upstream-key-env VAR`).
        self._any_key = self.pool_keys.get("*")
        # The x-ratelimit headers of each request with a tenant's lease, by its headers dict.
        self.rate: dict[int, dict[str, str]] = {}

    def of(self, request: web.Request, rid: str) -> dict[str, str]:
        """What of the client's request goes upstream (the pool's key is added per endpoint,
        `upstream`)."""
        h = {k: v for k, v in request.headers.items() if k.lower() not in self._skip}
        h["Content-Type"] = "application/json"
        h["X-Request-ID"] = rid
        return h

    def upstream(self, base: dict[str, str], ep: Endpoint) -> dict[str, str]:
        """`base` plus the credential of `ep`'s pool, if it has one."""
        key = self.pool_keys.get(ep.pool, self._any_key)
        return {**base, "Authorization": f"Bearer {key}"} if key else base

    def response(self, base: dict[str, str], ep: Endpoint | None) -> dict[str, str]:
        """The gateway's own headers on an answer to the request whose upstream headers are
        `base`."""
        h = {"X-Request-ID": base["X-Request-ID"]}
        if self.endpoint_header and ep is not None:
            h["X-Unbroken-Endpoint"] = ep.name
        if self.rate and (rl := self.rate.get(id(base))) is not None:
            h.update(rl)
        return h

    def done(self, base: dict[str, str]) -> None:
        """The request whose upstream headers are `base` is answered."""
        self.rate.pop(id(base), None)
