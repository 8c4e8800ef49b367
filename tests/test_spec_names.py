"""What a spec may name (config/spec.py, config/tenants.py), checked when it is read, each
error naming its field: served names that mean two things across pools, tenants that would
turn authentication off or could never match, a `redis_url` redis-py would refuse in a
started gateway. All of these used to be accepted (a user's review)."""

from __future__ import annotations

from typing import Any

import pytest

from unbroken.config.spec import GatewaySettings, SpecError, parse_spec
from unbroken.config.tenants import key_digest

KA, KB = key_digest("sk-a"), key_digest("sk-b")


def refused(spec: dict[str, Any]) -> str:
    with pytest.raises(SpecError) as e:
        parse_spec(spec)
    return str(e.value)


# -- served names -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("pools", "error"),
    [
        # The review's case: all base-b traffic went to pa's adapter.
        (
            [
                {"name": "pa", "adapters": {"sql": "/l/sql", "base-b": "/l/chat"}},
                {"name": "pa2"},
                {"name": "pb", "model": "base-b"},
            ],
            "pools.0.adapters.base-b: also the model of pool pb",
        ),
        (
            [{"name": "pa", "adapters": {"sql": "/l/sql"}}, {"name": "pb", "aliases": ["sql"]}],
            "pools.0.adapters.sql: also an alias of pool pb (model base-a)",
        ),
        (
            [{"name": "pa", "aliases": ["base-b"]}, {"name": "pb", "model": "base-b"}],
            "pools.0.aliases.0: also the model of pool pb",
        ),
        (
            [
                {"name": "pa", "aliases": ["chat"]},
                {"name": "pb", "model": "b", "aliases": ["chat"]},
            ],
            "pools.1.aliases.0: also an alias of pool pa (model base-a)",
        ),
        (
            [{"name": "pa", "adapters": {"base-a": "/l/x"}}],
            "pools.0.adapters.base-a: also the model of pool pa",
        ),
        (
            [
                {"name": "fp16", "adapters": {"sql": "/l/sql"}},
                {"name": "fp8", "precision": "fp8", "adapters": {"sql": "/l/sql-v2"}},
            ],
            "pools.1.adapters.sql: also an adapter of pool fp16 (base base-a) with another path",
        ),
        (
            [
                {"name": "pa", "adapters": {"sql": "/l/sql"}},
                {"name": "pb", "model": "base-b", "adapters": {"sql": "/l/sql"}},
            ],
            "pools.1.adapters.sql: also an adapter of pool pa (base base-a)",
        ),
        (
            [{"name": "pa", "adapters": [{"name": "sql", "path": "/l/sql", "base": "base-b"}]}],
            "pools.0.adapters.sql.base: base-b is not a model pool pa serves",
        ),
    ],
)
def test_a_served_name_means_one_model(pools: list[dict[str, Any]], error: str) -> None:
    msg = refused({"model": "base-a", "pools": pools})
    assert error in msg, msg
    assert "Value error" not in msg


def test_pools_of_one_model_may_serve_the_same_names() -> None:
    """A primary and a fallback of one model (fp16 and fp8 tiers) with the same aliases and
    adapters (same path; no path is the name), an adapter on an alias of its pool's model,
    an alias equal to its own model: all valid, as docs/pipeline.md "Several models" says."""
    spec = parse_spec(
        {
            "model": "base-a",
            "pools": [
                {
                    "name": "fp16",
                    "aliases": ["chat", "base-a"],
                    "adapters": {"sql": "/l/sql", "support": None},
                },
                {
                    "name": "fp8",
                    "precision": "fp8",
                    "aliases": ["chat"],
                    "adapters": [
                        {"name": "sql", "path": "/l/sql"},
                        {"name": "support"},
                        {"name": "legal", "path": "/l/legal", "base": "chat"},
                    ],
                },
                {"name": "other", "model": "base-b", "adapters": {"poet": "/l/poet"}},
            ],
        }
    )
    assert spec.gateway_settings().pool_models["fp8"] == [
        "base-a",
        "chat",
        "sql",
        "support",
        "legal",
    ]


# -- tenants ------------------------------------------------------------------------------------
def test_an_empty_tenant_list_is_refused() -> None:
    """`tenants: []` used to turn API keys off (every request accepted)."""
    msg = refused({"pools": [{"name": "p"}], "tenants": []})
    assert msg.startswith("spec: tenants: an empty list") and "remove `tenants:`" in msg, msg
    with pytest.raises(ValueError, match="remove `tenants:`"):
        GatewaySettings.model_validate({"tenants": []})  # a gateway's own --config too
    assert GatewaySettings.model_validate({}).tenants is None


@pytest.mark.parametrize(
    ("tenants", "error"),
    [
        ([{"name": "none", "api_keys": [KA]}], "tenants.0.name: none is reserved"),
        (
            [{"name": "a", "api_keys": [KA]}, {"name": "b", "api_keys": [KB, KA]}],
            "tenants.1.api_keys.1: also a key of tenant a",
        ),
        (
            [{"name": "a", "api_keys": [KA]}, {"name": "a", "api_keys": [KB]}],
            "tenants.1.name: a is also the name of tenants.0",
        ),
        (
            [{"name": "a", "api_keys": [KA]}, {"name": "anonymos"}],
            "tenants.1.api_keys: tenant anonymos has no API key",
        ),
    ],
)
def test_tenants_are_checked(tenants: list[dict[str, Any]], error: str) -> None:
    msg = refused({"pools": [{"name": "p"}], "tenants": tenants})
    assert error in msg, msg
    assert "sha256" not in msg  # no digest in an error


def test_limit_names_and_key_prefix() -> None:
    """An unknown limit (OpenAI's own `tokens_per_minute`) names the four there are; the
    digest's prefix is read in any case, as its hex digits are."""
    msg = refused(
        {
            "pools": [{"name": "p"}],
            "tenants": [{"name": "a", "api_keys": [KA], "limits": {"tokens_per_minute": 9}}],
        }
    )
    assert "tenants.0.limits: unknown limit tokens_per_minute; the limits are " in msg, msg
    assert "prompt_tokens_per_minute, completion_tokens_per_minute" in msg, msg
    upper = "SHA256:" + KA.removeprefix("sha256:").upper()
    spec = parse_spec({"pools": [{"name": "p"}], "tenants": [{"name": "a", "api_keys": [upper]}]})
    assert spec.tenants is not None and spec.tenants[0].api_keys == [KA]


def test_local_shares_of_small_limits_are_warned_of() -> None:
    from unbroken.config.tenants import local_overruns

    spec = parse_spec(
        {
            "pools": [{"name": "p"}],
            "tenants": [
                {"name": "a", "api_keys": [KA], "limits": {"concurrent_streams": 1}},
                {"name": "b", "api_keys": [KB], "limits": {"requests_per_minute": 3}},
            ],
        }
    )
    assert local_overruns(spec.tenants, 1) == []
    (one,) = local_overruns(spec.tenants, 2)
    assert one.startswith("tenant a: concurrent_streams 1 is below the 2 gateway replicas")
    assert len(local_overruns(spec.tenants, 4)) == 2


@pytest.mark.parametrize(
    ("header", "error"),
    [
        ("", "'' is not an HTTP header name"),
        ("bad header", "'bad header' is not an HTTP header name"),
        ("Authorization", "Authorization carries something else"),
    ],
)
def test_session_header_is_a_header_of_its_own(header: str, error: str) -> None:
    """A name no request can carry switched session routing off without a word, and
    `authorization` made every API key a conversation."""
    msg = refused({"pools": [{"name": "p"}], "gateway": {"session_header": header}})
    assert f"gateway.session_header: {error}" in msg, msg


def test_valid_tenants() -> None:
    spec = parse_spec(
        {
            "pools": [{"name": "p"}],
            "tenants": [
                {"name": "a", "api_keys": [KA, KA]},  # twice for one tenant: harmless
                {"name": "anonymous", "priority": "sheddable"},
                {"name": "None", "api_keys": [KB]},  # only `none` is the metrics' label
            ],
        }
    )
    assert [t.name for t in spec.gateway_settings().tenants or []] == ["a", "anonymous", "None"]


# -- the rate-limit store -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("url", "shown"),
    [("http://127.0.0.1:26379/0", "not http://"), ("127.0.0.1:6379", "e.g. redis://")],
)
def test_a_redis_url_redis_py_would_refuse_is_refused_when_read(url: str, shown: str) -> None:
    """It used to pass the spec and crash every gateway worker at start (redis-py's
    ValueError), a crash loop after a reload."""
    msg = refused({"pools": [{"name": "p"}], "rate_limit": {"store": "redis", "redis_url": url}})
    assert msg.startswith("spec: rate_limit.redis_url: must start with redis://"), msg
    assert shown in msg


@pytest.mark.parametrize(
    "url", ["redis://r:6379/0", "rediss://:secret@r:6380/1", "unix:///run/redis.sock", "REDIS://r"]
)
def test_redis_urls_redis_py_takes(url: str) -> None:
    spec = parse_spec(
        {"pools": [{"name": "p"}], "rate_limit": {"store": "redis", "redis_url": url}}
    )
    assert spec.gateway_settings().rate_limit.redis_url == url


def test_a_bad_redis_url_does_not_echo_a_password() -> None:
    msg = refused(
        {
            "pools": [{"name": "p"}],
            "rate_limit": {"store": "redis", "redis_url": "http://:hunter2@r:6379/0"},
        }
    )
    assert "hunter2" not in msg
