"""Real vLLM with a model whose output re-tokenizes canonically (only whole " word" tokens),
both servers also serving LoRA adapters.

LoRA (first, while both servers run): the names the gateway lists and routes by are vLLM's
own, an adapter request is answered by that adapter (byte-exact against vLLM direct, and not
the base model's text), adapter affinity keeps an adapter on the replica that runs it, an
adapter loaded at runtime on one replica is routed there only, and the gateway reads real
vLLM's `vllm:lora_requests_info`. Both servers start with adapter `ad1` (`--enable-lora
--lora-modules`) and runtime loading allowed (`VLLM_ALLOW_RUNTIME_LORA_UPDATING`); the
adapters are built with the models (vllmstack.build_models, build_lora.py: random weights in
PEFT's layout; nothing is downloaded). These tests use a gateway of their own, without pools,
on the stack's servers.

Then the canonical model's point (the module's last test, `a` killed): a migrated stream is
byte-exact, and so is the text that a re-tokenizing engine would see.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_vllm_gateway import USAGE, chat, check_exact, comp, generating, streams
from vllmstack import MODEL, Stack, Vllm, references

from helpers import Proc, admin, gateway, metric, wait_for

# serial: the two vLLM servers are pinned one per core; nothing else of the run beside them
pytestmark = [pytest.mark.timeout(1500), pytest.mark.serial]


class LoraStack:
    def __init__(self, a: Vllm, b: Vllm, g: Proc, adapters: dict[str, Path]) -> None:
        self.a, self.b, self.g, self.adapters = a, b, g, adapters

    def name(self, v: Vllm) -> str:
        return f"127.0.0.1:{v.port}"


@pytest.fixture(scope="module")
def lora_stack(
    tmp_path_factory: pytest.TempPathFactory, stack_canonical: Stack, model_dirs: dict[str, Path]
) -> Iterator[LoraStack]:
    tmp = tmp_path_factory.mktemp("vllm-lora")
    s = stack_canonical
    g = gateway(tmp, s.a.url, s.b.url)
    yield LoraStack(s.a, s.b, g, {k: model_dirs[k] for k in ("ad1", "ad2")})
    g.stop()


def acomp(model: str, prompt: str, n: int = 12) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}


def post(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


def _card(m: dict[str, Any]) -> tuple[Any, ...]:
    # `created` and the permission's id are stamped at each call by vLLM.
    return (m["id"], m["object"], m["owned_by"], m["root"], m["parent"], m["max_model_len"])


def test_models_and_adapter_texts_are_vllms_own(lora_stack: LoraStack) -> None:
    s = lora_stack
    direct = httpx.get(s.a.url + "/v1/models", timeout=10).json()["data"]
    via = httpx.get(s.g.url + "/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in direct] == [MODEL, "ad1"]
    assert direct[1]["parent"] == MODEL and direct[1]["root"] == str(s.adapters["ad1"])
    assert [_card(m) for m in via] == [_card(m) for m in direct]
    # The adapter's answer, through the gateway, is vLLM's own for that adapter (either
    # server: same weights), and not the base model's.
    prompt = "The adapter says"
    want = post(s.a.url, acomp("ad1", prompt)).json()["choices"][0]["text"]
    base = post(s.a.url, acomp(MODEL, prompt)).json()["choices"][0]["text"]
    assert want != base  # the adapter changes the text: a misrouted request would show
    r = post(s.g.url, acomp("ad1", prompt))
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "ad1" and r.json()["choices"][0]["text"] == want
    r = post(s.g.url, acomp("no-such-adapter", prompt))
    assert r.status_code == 404 and r.json()["error"]["message"], r.text


def test_adapter_affinity_and_vllms_lora_requests_info(lora_stack: LoraStack) -> None:
    """Sequential ad1 requests with unrelated prompts (no prefix to share) stay on one
    replica; the gateway's reading of that replica's `vllm:lora_requests_info` (admin API)
    has vLLM's `max_lora` and shows ad1 there."""
    s = lora_stack
    served = []
    for i in range(6):
        r = post(s.g.url, acomp("ad1", f"unrelated prompt number {i} about topic {i * 7}", 4))
        assert r.status_code == 200, r.text
        served.append(r.headers["X-Unbroken-Endpoint"])
    assert len(set(served)) == 1, served
    home = served[0]

    def lora_of(name: str) -> dict[str, Any] | None:
        eps = admin(s.g, "GET", "/admin/endpoints").json()["endpoints"]
        return next(e["lora"] for e in eps if e["name"] == name)

    def seen() -> dict[str, Any] | None:
        info = lora_of(home)
        return info if info and "ad1" in info["recent"] + info["running"] else None

    info = wait_for(seen, timeout=15, what="ad1 in the gateway's view of vLLM's lora info")
    assert info["max_lora"] == 1


def test_adapter_loaded_at_runtime_is_routed_to_its_replica_only(lora_stack: LoraStack) -> None:
    s = lora_stack
    r = httpx.post(
        s.b.url + "/v1/load_lora_adapter",
        json={"lora_name": "ad2", "lora_path": str(s.adapters["ad2"])},
        timeout=60,
    )
    assert r.status_code == 200, r.text

    def listed() -> bool:
        via = httpx.get(s.g.url + "/v1/models", timeout=10).json()["data"]
        return any(m["id"] == "ad2" and m["parent"] == MODEL for m in via)

    wait_for(listed, timeout=15, what="ad2 in the gateway's /v1/models")
    want = post(s.b.url, acomp("ad2", "Loaded at runtime")).json()["choices"][0]["text"]
    for i in range(4):
        r = post(s.g.url, acomp("ad2", "Loaded at runtime"))
        assert r.status_code == 200, r.text
        assert r.headers["X-Unbroken-Endpoint"] == s.name(s.b), i  # a only knows ad1
        assert r.json()["choices"][0]["text"] == want
    assert post(s.a.url, acomp("ad2", "x")).status_code == 404  # vLLM's own refusal on `a`


# -- the canonical model: the module's last test (`a` is killed) -------------------------
def test_sigkill_mid_stream_is_byte_exact_on_a_canonical_model(stack_canonical: Stack) -> None:
    s = stack_canonical
    bodies = [
        ("/v1/completions", comp("Once upon a time", 400, **USAGE)),
        ("/v1/chat/completions", chat("Tell me a long story about the sea", 400, **USAGE)),
    ]
    refs = references(s.b.url, bodies)
    for ref in refs:  # the model's output is whole words, which re-tokenize to themselves
        text = ref["choices"][0].get("text") or ref["choices"][0]["message"]["content"]
        assert text.startswith(" ") and all(w.isalpha() for w in text.split(" ")[1:])
    rs = streams(s, bodies)
    generating(s, rs)  # both streams reached their clients and are still generated on a
    s.a.signal(signal.SIGKILL)
    for r, ref in zip(rs, refs, strict=True):
        check_exact(r, ref)
    assert metric(s.g.url, "unbroken_gateway_migration_path_total", path="tokens") == 2
