"""A tenant limited to some models (`models:`, as LiteLLM's key `models`): the others are
answered as models that do not exist (the same 404, so a tenant learns nothing of what
others are served), on completions, chat, the engine routes passed through and
`/v1/models/{id}`, and `/v1/models` lists only its own. Real gateway and engine processes,
the official openai client."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from helpers import Proc, engine, gateway
from unbroken.config.tenants import key_digest

KEYS = {"narrow": "sk-narrow", "wide": "sk-wide"}


@pytest.fixture
def gw(tmp_path: Path) -> Iterator[Proc]:
    a = engine(tmp_path, "--served-model-name", "llama-8b", "llama", name="a")
    b = engine(tmp_path, "--served-model-name", "qwen-7b", name="b")
    cfg = tmp_path / "gw.json"
    cfg.write_text(
        json.dumps(
            {
                "tenants": [
                    {
                        "name": "narrow",
                        "api_keys": [key_digest(KEYS["narrow"])],
                        "models": ["qwen-7b"],
                    },
                    {"name": "wide", "api_keys": [key_digest(KEYS["wide"])]},
                ]
            }
        )
    )
    g = gateway(tmp_path, f"a={a.url}", f"b={b.url}", args=("--config", str(cfg)))
    try:
        yield g
    finally:
        for x in (g, a, b):
            x.stop()


def _client(g: Proc, who: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=g.url + "/v1", api_key=KEYS[who], max_retries=0, timeout=30)


def test_a_tenant_sees_and_uses_only_its_models(gw: Proc) -> None:
    narrow, wide = _client(gw, "narrow"), _client(gw, "wide")
    assert [m.id for m in narrow.models.list().data] == ["qwen-7b"]
    assert {m.id for m in wide.models.list().data} == {"llama-8b", "llama", "qwen-7b"}
    assert narrow.models.retrieve("qwen-7b").id == "qwen-7b"
    with pytest.raises(openai.NotFoundError):
        narrow.models.retrieve("llama-8b")

    r = narrow.completions.create(model="qwen-7b", prompt="hello", max_tokens=3)
    assert r.choices[0].text
    for model in ("llama-8b", "llama"):  # the base and its alias
        with pytest.raises(openai.NotFoundError) as ei:
            narrow.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
        # Word for word what a model that does not exist gets.
        assert ei.value.body == {
            "message": f"The model `{model}` does not exist.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    wide.completions.create(model="llama", prompt="hello", max_tokens=3)

    # An engine route passed through (the Responses API) holds to the same list.
    h = {"Authorization": f"Bearer {KEYS['narrow']}"}
    for model, status in (("llama-8b", 404), ("qwen-7b", 200)):
        body = {"model": model, "input": "hello", "max_output_tokens": 3}
        t = httpx.post(gw.url + "/v1/responses", json=body, headers=h, timeout=30)
        assert t.status_code == status, t.text
    assert t.json()["model"] == "qwen-7b"
