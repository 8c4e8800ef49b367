"""The spec-wide parts of the gateway's settings (tenants, the rate-limit store, the names
each pool serves) reach the gateway the same way under `unbroken up` (gateway.json) and on
Kubernetes (the gateway's ConfigMap)."""

from __future__ import annotations

from pathlib import Path

import yaml

from unbroken.config.spec import GatewaySettings, parse_spec
from unbroken.config.tenants import key_digest
from unbroken.k8s import RenderOptions, render
from unbroken.pipeline.supervisor import render_gateway_settings

SPEC = {
    "model": "base-a",
    "pools": [
        {"name": "alpha", "aliases": ["a2"], "adapters": {"sql": "/x"}},
        {"name": "beta", "model": "base-b", "replicas": {"min": 0, "max": 2}},
    ],
    "tenants": [
        {
            "name": "acme",
            "api_keys": [key_digest("sk-acme")],
            "priority": "critical",
            "limits": {"requests_per_minute": 60},
        }
    ],
    "rate_limit": {"store": "redis", "redis_url": "redis://r:6379/0"},
}


def _check(settings: GatewaySettings) -> None:
    assert settings.pool_models == {"alpha": ["base-a", "a2", "sql"], "beta": ["base-b"]}
    assert settings.tenants is not None and settings.tenants[0].name == "acme"
    assert settings.tenants[0].api_keys == [key_digest("sk-acme")]
    assert settings.rate_limit.store == "redis"


def test_unbroken_up_renders_them() -> None:
    _check(render_gateway_settings(parse_spec(SPEC)))


def test_kubernetes_renders_them(tmp_path: Path) -> None:
    objs = render(parse_spec(SPEC), RenderOptions(namespace="t"))
    cm = next(
        o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("config")
    )
    text = cm["data"]["gateway.yaml"]
    assert "sk-acme" not in text  # only the digest
    _check(GatewaySettings.model_validate(yaml.safe_load(text)))
