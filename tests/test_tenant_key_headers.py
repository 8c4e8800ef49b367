"""A tenant's key in the headers other clients send it in: `api-key` (Azure OpenAI's
clients, the openai package's `AzureOpenAI` among them) and `x-api-key` (Anthropic-style
clients), as LiteLLM takes them; never passed on to the engines. Real gateway and engine
processes."""

from __future__ import annotations

from pathlib import Path

import httpx

from helpers import MODEL, engine, gateway, metric
from test_tenants import tenants_config
from unbroken.gateway._headers import HOP

KEY = "sk-azure-style-key"


def test_api_key_and_x_api_key_name_the_tenant(tmp_path: Path) -> None:
    e = engine(tmp_path)
    cfg = tenants_config(tmp_path / "gw.json", [{"name": "acme", "key": KEY}])
    g = gateway(tmp_path, e.url, args=("--config", str(cfg)))
    try:
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 3}
        for header in ("api-key", "x-api-key"):
            r = httpx.post(g.url + "/v1/completions", headers={header: KEY}, json=body, timeout=30)
            assert r.status_code == 200, (header, r.text)
            bad = httpx.post(g.url + "/v1/completions", headers={header: "sk-wrong"}, json=body,
                             timeout=30)  # fmt: skip
            assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"
        assert metric(g.url, "unbroken_gateway_tenant_requests_total", tenant="acme") == 2
        assert metric(g.url, "unbroken_gateway_tenant_requests_total", tenant="none") == 2
    finally:
        g.stop()
        e.stop()
    assert {"api-key", "x-api-key", "authorization"} <= HOP  # a client's key never goes up
