"""Who a request is (issue 25): the tenant its API key names, and the priority it may have.

With `tenants` set, the `Authorization: Bearer KEY` the openai client sends is hashed
(SHA-256) and looked up among the tenants' `api_keys`; the key itself is never stored,
logged or exported, and metrics name the tenant only. A key that matches nobody, or none
at all, is the `anonymous` tenant's when the spec has one, else 401 `invalid_api_key` as
OpenAI answers. A tenant's priority is a ceiling: the priority header may lower it, never
raise it (a tenant cannot make itself more important than the spec says).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from unbroken.config.tenants import ANONYMOUS
from unbroken.config.tenants import RESERVED as NONE  # the metrics' tenant of no tenant
from unbroken.gateway._admission import PRIORITIES
from unbroken.wire.errors import ApiError

if TYPE_CHECKING:
    from unbroken.config.tenants import TenantSpec

__all__ = ["ANONYMOUS", "NONE", "Tenants"]

_RANK = {p: i for i, p in enumerate(PRIORITIES)}


class Tenants:
    def __init__(self, specs: list[TenantSpec]) -> None:
        self.specs = {t.name: t for t in specs}
        self.by_digest = {k.partition(":")[2]: t for t in specs for k in t.api_keys}
        self.anonymous = self.specs.get(ANONYMOUS)

    def names(self) -> list[str]:
        return list(self.specs)

    def resolve(self, authorization: str | None) -> TenantSpec:
        """The tenant of a request's `Authorization` header, or 401."""
        key = None
        if authorization is not None:
            scheme, _, rest = authorization.strip().partition(" ")
            if scheme.lower() == "bearer" and rest.strip():
                key = rest.strip()
        if key is not None:
            # The bytes the client sent (aiohttp keeps undecodable ones as surrogates).
            raw = key.encode("utf-8", "surrogateescape")
            t = self.by_digest.get(hashlib.sha256(raw).hexdigest())
            if t is not None:
                return t
        if self.anonymous is not None:
            return self.anonymous
        raise ApiError(
            401,
            "Incorrect API key provided. You can find your API key with your gateway's operator."
            if key is not None
            else "You didn't provide an API key. You need to provide your API key in an "
            "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
            type="invalid_request_error",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


def priority_for(tenant: TenantSpec, asked: str | None) -> str:
    """The tenant's priority, or the lower one the request asked for (`asked`, already
    validated); never higher."""
    if asked is None or _RANK[asked] <= _RANK[tenant.priority]:
        return tenant.priority
    return asked
