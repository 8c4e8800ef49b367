"""Tenants (issue 25): who may call the gateway, at which priority and weight, within which
limits. A spec names each tenant's API keys only by their SHA-256 (`sha256:<hex>`), so a spec
file, a rendered gateway config and every log hold no secret."""

from __future__ import annotations

import hashlib
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from unbroken.config._base import Priority, _Spec

__all__ = ["RateLimitSettings", "TenantLimits", "TenantSpec", "key_digest"]

TenantName = Annotated[
    str, Field(min_length=1, max_length=63, pattern=r"^[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")
]


def key_digest(key: str) -> str:
    """The spec's form of an API key: `sha256:` and the hex digest of its UTF-8 bytes."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


class TenantLimits(_Spec):
    """Per tenant, summed over the gateway's workers and (with a shared store) replicas.
    Token limits count what the engines report (usage), a continued stream's tokens once."""

    requests_per_minute: Annotated[int, Field(ge=1)] | None = None
    prompt_tokens_per_minute: Annotated[int, Field(ge=1)] | None = None
    completion_tokens_per_minute: Annotated[int, Field(ge=1)] | None = None
    concurrent_streams: Annotated[int, Field(ge=1)] | None = None


class TenantSpec(_Spec):
    name: TenantName
    api_keys: list[str] = Field(default_factory=list, repr=False)
    priority: Priority = "standard"
    weight: Annotated[float, Field(gt=0, le=1000)] = 1.0
    limits: TenantLimits = Field(default_factory=TenantLimits)

    @field_validator("api_keys")
    @classmethod
    def _hashed(cls, keys: list[str]) -> list[str]:
        out = []
        for i, k in enumerate(keys):
            algo, _, hexd = k.partition(":")
            hexd = hexd.lower()
            if algo != "sha256" or len(hexd) != 64 or hexd.strip("0123456789abcdef"):
                # Never echo the value: it may be a raw key pasted by mistake.
                raise ValueError(
                    f"api_keys[{i}] must be 'sha256:<64 hex digits>' (the SHA-256 of the key; "
                    "`unbroken key-hash KEY` prints it), not the key itself"
                )
            out.append(f"sha256:{hexd}")
        return out


class RateLimitSettings(_Spec):
    """Where the tenants' counters live. `local`: each gateway replica enforces its share of
    every limit (limit / replicas, as the caps), exact across its own workers. `redis`: one
    count across all replicas in the Redis at `redis_url`; if it becomes unreachable, each
    replica falls back to its local share (logged once) and goes back when it returns."""

    store: Literal["local", "redis"] = "local"
    redis_url: str | None = None
    redis_timeout_s: Annotated[float, Field(gt=0, le=5)] = 0.05

    @model_validator(mode="after")
    def _url(self) -> RateLimitSettings:
        if self.store == "redis" and not self.redis_url:
            raise ValueError("rate_limit.store 'redis' needs rate_limit.redis_url")
        return self


def check_tenants(tenants: list[TenantSpec]) -> None:
    """Names unique, and no key shared by two tenants (which would make a key's tenant
    depend on spec order)."""
    names = [t.name for t in tenants]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"tenant names must be unique: {', '.join(dup)}")
    owner: dict[str, str] = {}
    for t in tenants:
        for k in t.api_keys:
            if k in owner and owner[k] != t.name:
                raise ValueError(f"tenants {owner[k]} and {t.name} share an API key")
            owner[k] = t.name
