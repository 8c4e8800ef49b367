"""Runtime LoRA adapters through a gateway with tenants and several models (a reviewer's
report, /tmp/review-tenants): only a tenant with `manage_adapters` may load or unload them
(403 otherwise) and each call is one of its requests (its request limit, its metrics); a
load may not take a name that is served or declared as another thing (a base model, an
alias, another base's adapter); a spec adapter unloaded at runtime is OpenAI's 404 at once
and leaves /v1/models, while a sleeping pool's names stay listed and queued; and the
`model_required` refusal names the base models, not their aliases.

The engines are the simulator: `primary` serves llama-8b (alias llama) with the adapter sql
and runtime loading on, `coder` serves qwen-coder-7b; the spec's names are given to the
gateway as `unbroken up` renders them (`pool_models`, `adapter_cards`), with a pool `sleepy`
that has no replica (autoscaled to 0)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers import Proc, engine, gateway, metric, ready_endpoint
from unbroken.config.tenants import key_digest
from unbroken.gateway._pool import Pool, State

KEYS = {"admin": "sk-admin", "ops": "sk-ops", "tiny": "sk-tiny", "acme": "sk-acme"}
RUNTIME = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Proc, Proc]]:
    tmp: Path = tmp_path_factory.mktemp("adapters")
    lora = ("--enable-lora", "--max-loras", "4", "--lora-modules", "sql=/a/sql")
    p = engine(tmp, "--served-model-name", "llama-8b", "llama", *lora, name="primary", env=RUNTIME)
    c = engine(tmp, "--served-model-name", "qwen-coder-7b", "--enable-lora", name="coder",
               env=RUNTIME)  # fmt: skip
    tenants: list[dict[str, Any]] = [
        {"name": "admin", "api_keys": [key_digest(KEYS["admin"])], "manage_adapters": True},
        {
            "name": "ops",
            "api_keys": [key_digest(KEYS["ops"])],
            "manage_adapters": True,
            "limits": {"requests_per_minute": 2},
        },
        {
            "name": "tiny",
            "api_keys": [key_digest(KEYS["tiny"])],
            "limits": {"requests_per_minute": 3},
        },
        {"name": "acme", "api_keys": [key_digest(KEYS["acme"])]},
    ]
    cfg = tmp / "gw.json"
    cfg.write_text(
        json.dumps(
            {
                "tenants": tenants,
                "queue_timeout_s": 1,
                "pool_models": {
                    "primary": ["llama-8b", "llama", "sql"],
                    "coder": ["qwen-coder-7b", "coder-sql"],
                    "sleepy": ["zzz-model"],
                },
                "sleeping_pools": ["sleepy"],  # autoscaled with min 0
                "adapter_cards": {
                    "sql": {"parent": "llama-8b", "root": "/a/sql"},
                    "coder-sql": {"parent": "qwen-coder-7b", "root": "/a/coder-sql"},
                },
            }
        )
    )
    g = gateway(tmp, f"primary={p.url}", f"coder={c.url}", args=("--config", str(cfg)))
    try:
        yield g, p, c
    finally:
        for x in (g, p, c):
            x.stop()


def _post(g: Proc, path: str, body: dict[str, Any], who: str = "admin") -> httpx.Response:
    return httpx.post(
        g.url + path, json=body, headers={"Authorization": f"Bearer {KEYS[who]}"}, timeout=30
    )


def _chat(g: Proc, model: str, who: str = "acme") -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return _post(g, "/v1/chat/completions", body, who)


def _name(e: Proc) -> str:
    """An engine's endpoint name in the gateway (`--endpoint POOL=URL`: its host:port)."""
    return e.url.removeprefix("http://")


def _ids(url: str, who: str | None = "acme") -> list[str]:
    h = {"Authorization": f"Bearer {KEYS[who]}"} if who else {}
    return [m["id"] for m in httpx.get(url + "/v1/models", headers=h, timeout=10).json()["data"]]


def test_only_tenants_that_manage_adapters_may_change_them(gw: tuple[Proc, Proc, Proc]) -> None:
    """tiny (3 rpm) and acme (no limits) get 403 in OpenAI's form, for a load and an unload,
    and the spec's adapter stays; the call is still one of their requests in the metrics."""
    g, p, _ = gw
    before = metric(g.url, "unbroken_gateway_tenant_requests_total", tenant="tiny")
    for who in ("tiny", "acme"):
        for path, body in (
            ("/v1/unload_lora_adapter", {"lora_name": "sql", "model": "llama-8b"}),
            ("/v1/load_lora_adapter", {"lora_name": "x1", "lora_path": "/x", "model": "llama-8b"}),
        ):
            r = _post(g, path, body, who)
            assert r.status_code == 403, (who, path, r.text)
            err = r.json()["error"]
            assert err["type"] == "permission_error" and "manage_adapters" in err["message"]
    assert "sql" in _ids(p.url, None) and "x1" not in _ids(p.url, None)
    assert _chat(g, "sql").status_code == 200
    after = metric(g.url, "unbroken_gateway_tenant_requests_total", tenant="tiny")
    assert after == before + 2


def test_adapter_calls_take_from_the_request_limit(gw: tuple[Proc, Proc, Proc]) -> None:
    """ops may manage adapters but has 2 requests a minute: two unloads (answered by the
    engine: nothing to unload) take both, with the x-ratelimit headers; the third is 429."""
    g, _, _ = gw
    body = {"lora_name": "never-loaded", "model": "llama-8b"}
    r1 = _post(g, "/v1/unload_lora_adapter", body, "ops")
    r2 = _post(g, "/v1/unload_lora_adapter", body, "ops")
    assert r1.status_code != 429 and r2.status_code != 429, (r1.text, r2.text)
    assert r1.headers["x-ratelimit-limit-requests"] == "2"
    assert r1.headers["x-ratelimit-remaining-requests"] == "1"
    assert r2.headers["x-ratelimit-remaining-requests"] == "0"
    r3 = _post(g, "/v1/unload_lora_adapter", body, "ops")
    assert r3.status_code == 429, r3.text
    assert r3.json()["error"]["code"] == "rate_limit_exceeded" and "retry-after" in r3.headers
    assert metric(g.url, "unbroken_gateway_tenant_requests_total", tenant="ops") == 3
    assert metric(g.url, "unbroken_gateway_tenant_requests_total", tenant="ops", status="429") == 1


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("qwen-coder-7b", "a model the gateway serves"),  # another pool's base
        ("llama", "a model the gateway serves"),  # the base's own alias
        ("llama-8b", "a model the gateway serves"),
        ("coder-sql", "an adapter of `qwen-coder-7b` in the spec"),
        ("zzz-model", "a model the spec declares (pool sleepy)"),  # a sleeping pool's
    ],
)
def test_a_load_may_not_take_another_things_name(
    gw: tuple[Proc, Proc, Proc], name: str, why: str
) -> None:
    g, p, c = gw
    body = {"lora_name": name, "lora_path": "/x", "model": "llama-8b"}
    r = _post(g, "/v1/load_lora_adapter", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "adapter_name_taken" and err["param"] == "lora_name"
    assert why in err["message"] and f"`{name}`" in err["message"]
    # Nothing was loaded: the engine lists no adapter of that name, and the name still
    # reaches what it named.
    cards = httpx.get(p.url + "/v1/models", timeout=10).json()["data"]
    assert not [m for m in cards if m["id"] == name and m.get("parent")], cards
    if name == "qwen-coder-7b":
        for _ in range(3):
            r = _chat(g, name)
            assert r.status_code == 200 and r.headers["x-unbroken-endpoint"] == _name(c)


def test_a_spec_adapter_unloaded_is_404_at_once_and_unlisted(gw: tuple[Proc, Proc, Proc]) -> None:
    """sql unloaded at runtime while primary is up: /v1/models no longer lists it and a
    request is OpenAI's 404 at once (it waited the queue timeout for a wake-up before and
    got 429 queue_timeout); the sleeping pool's model is still listed and still queued.
    Loaded again, sql is served again."""
    g, _, _ = gw
    r = _post(g, "/v1/unload_lora_adapter", {"lora_name": "sql", "model": "llama-8b"})
    assert r.status_code == 200, r.text
    try:
        ids = _ids(g.url)
        assert "sql" not in ids and {"llama-8b", "llama", "qwen-coder-7b", "zzz-model"} <= set(ids)
        h = {"Authorization": f"Bearer {KEYS['acme']}"}
        assert httpx.get(g.url + "/v1/models/sql", headers=h, timeout=10).status_code == 404
        t0 = time.monotonic()
        r = _chat(g, "sql")
        took = time.monotonic() - t0
        assert r.status_code == 404, r.text
        err = r.json()["error"]
        assert err["code"] == "model_not_found"
        assert err["message"] == "The model `sql` does not exist."
        assert took < 0.9, took  # under the queue timeout (1 s here, 30 s by default)
        # A sleeping pool (no replica) still takes its names: queued, for the wake-up.
        r = _chat(g, "zzz-model")
        # Waiting for the sleeping pool to wake, not "at capacity".
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_waking", r.text
    finally:
        again = _post(g, "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/a/sql",
                                                     "model": "llama-8b"})  # fmt: skip
    assert again.status_code == 200, again.text  # the spec's own adapter on its own base
    assert "sql" in _ids(g.url)
    assert _chat(g, "sql").status_code == 200


def test_model_required_names_the_base_models(gw: tuple[Proc, Proc, Proc]) -> None:
    g, _, _ = gw
    r = _post(g, "/v1/load_lora_adapter", {"lora_name": "x2", "lora_path": "/x"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "model_required"
    assert "(llama-8b, qwen-coder-7b)" in err["message"], err["message"]


def test_a_loaded_adapter_is_served_on_its_base(gw: tuple[Proc, Proc, Proc]) -> None:
    g, p, c = gw
    r = _post(g, "/v1/load_lora_adapter", {"lora_name": "fresh", "lora_path": "/x",
                                           "model": "llama-8b"})  # fmt: skip
    assert r.status_code == 200, r.text
    assert "fresh" in _ids(p.url, None) and "fresh" not in _ids(c.url, None)
    r = _chat(g, "fresh")
    assert r.status_code == 200 and r.headers["x-unbroken-endpoint"] == _name(p)


def test_spec_names_of_an_up_pool_are_served_only_when_listed() -> None:
    """`Pool.known_models` / `configured`: a name the spec gives a pool counts as served by
    a sleeping pool only while that pool has no ready replica."""
    pool = Pool(default_cap=4)
    pool.configure({"p": ["m", "sql"], "sleepy": ["z"], "q": ["m2"]})
    ep = ready_endpoint("e", pool="p")  # serves "m", not "sql"
    pool.add(ep)
    starting = ready_endpoint("s", pool="q")
    starting.set_state(State.STARTING)
    pool.add(starting)
    assert pool.known_models() == {"m", "z", "m2"}
    assert pool.configured("sql") is None  # p is up and none of its replicas lists it
    assert pool.configured("z") == "sleepy"
    assert pool.configured("m2") == "q"  # waking: still waited for
    ep.set_state(State.DRAINING)  # p has no ready replica now: asleep again
    assert pool.configured("sql") == "p" and "sql" in pool.known_models()
