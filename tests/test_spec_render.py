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
    cfg = next(
        o for o in objs if o["kind"] == "Secret" and o["metadata"]["name"].endswith("config")
    )
    text = cfg["stringData"]["gateway.yaml"]
    assert "sk-acme" not in text  # only the digest
    _check(GatewaySettings.model_validate(yaml.safe_load(text)))


def test_kubernetes_keeps_the_gateway_secrets_in_a_secret(tmp_path: Path) -> None:
    """`priority_keys` (raw API keys) and a `redis_url` with a password are in no ConfigMap
    and in no pod spec: the gateway's one settings file is mounted from a Secret, and the
    gateway's own loader reads them from the written file."""
    from unbroken.gateway.config import prepare
    from unbroken.k8s import write

    data = {
        **SPEC,
        "rate_limit": {"store": "redis", "redis_url": "redis://:hunter2@r:6379/0"},
        "gateway": {"priority_keys": {"sk-raw-secret-key": "critical"}},
    }
    objs = render(parse_spec(data), RenderOptions(namespace="t"))
    for o in objs:
        text = yaml.safe_dump(o)
        if o["kind"] != "Secret":
            assert "sk-raw-secret-key" not in text and "hunter2" not in text, o["kind"]
    gw = next(
        o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("gateway")
    )
    vols = {v["name"]: v for v in gw["spec"]["template"]["spec"]["volumes"]}
    assert vols["config"] == {"name": "config", "secret": {"secretName": "unbroken-gateway-config"}}
    paths = write(objs, tmp_path / "out")
    (path,) = [p for p in paths if p.name.endswith("-secret-unbroken-gateway-config.yaml")]
    mounted = tmp_path / "gateway.yaml"  # what the Secret volume shows the gateway
    mounted.write_text(yaml.safe_load(path.read_text())["stringData"]["gateway.yaml"])
    cfg = prepare([], mounted, {}).cfg
    assert cfg.priority_keys == {"sk-raw-secret-key": "critical"}
    assert cfg.rate_limit.redis_url == "redis://:hunter2@r:6379/0"
