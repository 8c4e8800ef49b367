"""Tenants (issue 25): who may call the gateway, at which priority and weight, within which
limits. A spec names each tenant's API keys only by their SHA-256 (`sha256:<hex>`), so a spec
file, a rendered gateway config and every log hold no secret."""

from __future__ import annotations

import hashlib
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from unbroken.config._base import Priority, _Spec

__all__ = [
    "RateLimitSettings",
    "TenantLimits",
    "TenantSpec",
    "check_tenants",
    "key_digest",
    "local_overruns",
]

# Both are the gateway's too (gateway/_tenants.py: ANONYMOUS, and RESERVED as NONE).
ANONYMOUS = "anonymous"  # takes the requests whose key matches no tenant
# The metrics' tenant of requests that have none (no tenants configured, or refused with
# 401): a tenant of that name would be counted with them.
RESERVED = "none"
REDIS_SCHEMES = ("redis", "rediss", "unix")  # what redis-py's from_url takes

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

    @model_validator(mode="before")
    @classmethod
    def _known(cls, v: Any) -> Any:
        """An unknown limit names the four there are (OpenAI's own `tokens_per_minute` is
        two here: prompt and completion)."""
        if isinstance(v, dict):
            unknown = sorted(str(k) for k in v if k not in cls.model_fields)
            if unknown:
                raise ValueError(
                    f"unknown limit {', '.join(unknown)}; the limits are "
                    f"{', '.join(cls.model_fields)}"
                )
        return v


class TenantSpec(_Spec):
    name: TenantName
    api_keys: list[str] = Field(default_factory=list, repr=False)
    priority: Priority = "standard"
    weight: Annotated[float, Field(gt=0, le=1000)] = 1.0
    limits: TenantLimits = Field(default_factory=TenantLimits)
    # May call `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` (which change what
    # every tenant is served): off unless the spec says so (403 otherwise).
    manage_adapters: bool = False
    # The models (served names, aliases, adapters) this tenant may use, as LiteLLM's key
    # `models`; None: every one. Others are answered as a model that does not exist (404),
    # and /v1/models lists only these.
    models: list[Annotated[str, Field(min_length=1)]] | None = None

    @field_validator("api_keys")
    @classmethod
    def _hashed(cls, keys: list[str]) -> list[str]:
        out = []
        for i, k in enumerate(keys):
            algo, _, hexd = k.partition(":")
            algo, hexd = algo.lower(), hexd.lower()
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

    @field_validator("redis_url")
    @classmethod
    def _scheme(cls, url: str | None) -> str | None:
        if url is None:
            return url
        scheme = urlsplit(url).scheme.lower() if "://" in url else ""
        if scheme not in REDIS_SCHEMES:
            # Only the scheme is echoed: the rest may hold a password.
            raise ValueError(
                "must start with redis://, rediss:// or unix:// (as redis-py takes it), "
                + (
                    f"not {scheme}://"
                    if scheme and len(scheme) <= 16
                    else "e.g. redis://HOST:6379/0"
                )
            )
        return url

    @model_validator(mode="after")
    def _url(self) -> RateLimitSettings:
        if self.store == "redis" and not self.redis_url:
            raise ValueError("rate_limit.store 'redis' needs rate_limit.redis_url")
        return self


def check_tenants(tenants: list[TenantSpec]) -> None:
    """A list that enables authentication (not empty), names unique and not reserved, each
    tenant reachable (a key, or the `anonymous` tenant), no key shared by two tenants (which
    would make a key's tenant depend on spec order). Errors name the field
    (`tenants.1.api_keys.0: ...`)."""
    if not tenants:
        raise ValueError(
            "tenants: an empty list would turn API keys off (every request accepted, as "
            "without tenants); remove `tenants:` to run without tenants, or list at least one "
            f"(a tenant named {ANONYMOUS} takes the requests whose key matches none)"
        )
    first: dict[str, int] = {}
    owner: dict[str, str] = {}
    for i, t in enumerate(tenants):
        if t.name == RESERVED:
            raise ValueError(
                f"tenants.{i}.name: {RESERVED} is reserved (the metrics' tenant of requests "
                "that have none: refused with 401, or served without tenants)"
            )
        if t.name in first:
            raise ValueError(
                f"tenants.{i}.name: {t.name} is also the name of tenants.{first[t.name]}; "
                "tenant names must be unique"
            )
        first[t.name] = i
        if not t.api_keys and t.name != ANONYMOUS:
            raise ValueError(
                f"tenants.{i}.api_keys: tenant {t.name} has no API key, so no request could "
                f"ever be its (only the tenant named {ANONYMOUS} needs none: it takes the "
                "requests whose key matches no tenant)"
            )
        for j, k in enumerate(t.api_keys):  # twice in one tenant: harmless, accepted
            if owner.setdefault(k, t.name) != t.name:
                raise ValueError(
                    f"tenants.{i}.api_keys.{j}: also a key of tenant {owner[k]}; a key names "
                    "one tenant"
                )


def local_overruns(tenants: list[TenantSpec] | None, replicas: int) -> list[str]:
    """With `store: local`, each of `replicas` gateway replicas enforces its share of every
    limit, at least 1: a limit below the replica count is exceeded (up to `replicas`). One
    line per such limit, for a warning."""
    out = []
    for t in tenants or []:
        for key, v in t.limits.model_dump().items():
            if v is not None and v < replicas:
                out.append(
                    f"tenant {t.name}: {key} {v} is below the {replicas} gateway replicas; "
                    f"with rate_limit.store local each replica allows at least 1, so up to "
                    f"{replicas} in all (rate_limit.store: redis counts it exactly)"
                )
    return out
