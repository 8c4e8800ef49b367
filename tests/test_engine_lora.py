"""The simulator's served names and LoRA adapters, as vLLM's OpenAI server: real processes
started with vLLM's flag syntax (`python -m unbroken.engine`)."""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers import FAST, TOKEN, Proc, engine, wait_for
from unbroken.engine import expected_chat, expected_completion
from unbroken.engine.cli_args import vllm_options
from unbroken.engine.lora import LoRAModule, parse_lora_modules
from unbroken.wire.http import free_port

A2 = '{"name": "a2", "path": "/lora/a2", "base_model_name": "alias"}'
NAMES = ("--served-model-name", "base", "alias")
LORA = ("--enable-lora", "--lora-modules", "a1=/lora/a1", A2)


def lora_engine(
    tmp: Path, *args: str, name: str = "engine", env: dict[str, str] | None = None
) -> Proc:
    port = free_port()
    argv = [sys.executable, "-m", "unbroken.engine", "--port", str(port), *FAST, *args]
    env = {"UNBROKEN_ADMIN_TOKEN": TOKEN, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "", **(env or {})}
    return Proc(argv, port, tmp / f"{name}-{port}.log", env=env).start()


def complete(p: Proc, model: str, prompt: str = "tell me", n: int = 12) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0}
    return httpx.post(p.url + "/v1/completions", json=body, timeout=30)


def lora_info(p: Proc) -> list[tuple[float, dict[str, str]]]:
    """Every vllm:lora_requests_info sample, latest first, read with prometheus_client."""
    text = httpx.get(p.url + "/metrics", timeout=5).text
    fams = [f for f in text_string_to_metric_families(text) if f.name == "vllm:lora_requests_info"]
    assert len(fams) == 1 and fams[0].type == "gauge"
    return sorted(((s.value, s.labels) for s in fams[0].samples), key=lambda s: -s[0])


def _raw_stream(p: Proc, body: dict) -> socket.socket:
    payload = orjson.dumps({**body, "stream": True})
    s = socket.create_connection(("127.0.0.1", p.port))
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload
    )
    s.recv(1024)
    return s


# -- flags --------------------------------------------------------------------------------------
def test_lora_modules_parse_as_vllm() -> None:
    assert parse_lora_modules(["a=/x", "", A2]) == [
        LoRAModule("a", "/x"),
        LoRAModule("a2", "/lora/a2", "alias"),
    ]
    for bad in ("a=b=c", "{not json", '{"name": "a"}', '{"name": "a", "path": "/x", "rank": 8}'):
        with pytest.raises(ValueError):
            parse_lora_modules([bad])
    opts = vllm_options(
        ["alias", "--enable-lora", "--lora-modules", "a=/x", A2, "--max-loras", "2"]
    )
    assert opts["aliases"] == ("alias",) and opts["enable_lora"] and opts["max_loras"] == 2
    assert [m.name for m in opts["lora_modules"]] == ["a", "a2"]
    with pytest.raises(ValueError):
        vllm_options(["--max-loras", "two"])
    with pytest.raises(ValueError):
        vllm_options(["--what"])


def test_lora_modules_without_enable_lora_refuse_to_start(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="needs --enable-lora"):
        lora_engine(tmp_path, "--lora-modules", "a=/x")
    with pytest.raises(ValueError, match="needs --enable-lora"):
        vllm_options(["--lora-modules", "a=/x"])


def test_unbroken_engine_takes_the_same_flags(tmp_path: Path) -> None:
    """`unbroken engine` (typer) hands what it does not know to `vllm_options`."""
    p = engine(tmp_path, *NAMES, *LORA, "--max-loras", "2")
    try:
        assert [c["id"] for c in httpx.get(p.url + "/v1/models").json()["data"]] == [
            "base",
            "alias",
            "a1",
            "a2",
        ]
        body = complete(p, "a2").json()
        assert body["model"] == "a2"
        assert body["choices"][0]["text"] == expected_completion("tell me", 12, adapter="a2").text
        assert 'max_lora="2"' in httpx.get(p.url + "/metrics").text
    finally:
        p.stop()


# -- names, adapters, 404 -----------------------------------------------------------------------
def test_several_names_and_adapters_each_write_their_own_text(tmp_path: Path) -> None:
    p = lora_engine(tmp_path, *NAMES, *LORA, "--seed", "7")
    try:
        cards = httpx.get(p.url + "/v1/models").json()["data"]
        # One card per served name, then each adapter: root = its path, parent = its base
        # (the first served name unless the module names another).
        assert [(c["id"], c["root"], c["parent"]) for c in cards] == [
            ("base", "base", None),
            ("alias", "base", None),
            ("a1", "/lora/a1", "base"),
            ("a2", "/lora/a2", "alias"),
        ]
        assert cards[0]["max_model_len"] and cards[2]["max_model_len"] is None

        texts = {}
        for model, adapter, answer_as in (
            ("base", "", "base"),
            # Every served name is the same model; a response names what was asked for, as
            # vLLM's _get_model_name (it said the first name before).
            ("alias", "", "alias"),
            ("a1", "a1", "a1"),
            ("a2", "a2", "a2"),
        ):
            r = complete(p, model)
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["model"] == answer_as
            want = expected_completion("tell me", 12, seed=7, adapter=adapter).text
            assert body["choices"][0]["text"] == want
            texts[model] = want
        assert texts["base"] == texts["alias"]
        assert len({texts["base"], texts["a1"], texts["a2"]}) == 3  # byte-distinct

        msgs = [{"role": "user", "content": "hello there"}]
        r = httpx.post(
            p.url + "/v1/chat/completions",
            json={"model": "a1", "messages": msgs, "max_tokens": 9, "temperature": 0},
        )
        assert r.json()["choices"][0]["message"]["content"] == (
            expected_chat(msgs, 9, seed=7, adapter="a1").text
        )
        assert r.json()["model"] == "a1"

        r = complete(p, "a3")
        assert r.status_code == 404
        assert r.json()["error"]["message"] == "The model `a3` does not exist."
        assert r.json()["error"]["code"] == "model_not_found"
        # The metrics' model_name is the first served name.
        assert 'model_name="base"' in httpx.get(p.url + "/metrics").text
        assert httpx.post(p.url + "/v1/load_lora_adapter", json={}).status_code == 404
    finally:
        p.stop()


# -- runtime loading ----------------------------------------------------------------------------
def test_runtime_load_and_unload_with_the_env_var(tmp_path: Path) -> None:
    p = lora_engine(tmp_path, *NAMES, *LORA, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    off = lora_engine(tmp_path, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}, name="nolora")
    try:
        load, unload = p.url + "/v1/load_lora_adapter", p.url + "/v1/unload_lora_adapter"
        assert complete(p, "a3").status_code == 404
        r = httpx.post(load, json={"lora_name": "a3", "lora_path": "/lora/a3"})
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'a3' added successfully."
        card = {c["id"]: c for c in httpx.get(p.url + "/v1/models").json()["data"]}["a3"]
        assert card["root"] == "/lora/a3" and card["parent"] == "base"
        r3 = complete(p, "a3")
        assert (
            r3.json()["choices"][0]["text"] == expected_completion("tell me", 12, adapter="a3").text
        )
        # vLLM's checks: both fields, no second load of a name, unload of a known name only.
        r = httpx.post(load, json={"lora_name": "a3", "lora_path": "/elsewhere"})
        assert r.status_code == 400
        assert r.json()["error"] == {
            "message": "The lora adapter 'a3' has already been loaded.",
            "type": "InvalidUserInput",
            "param": None,
            "code": 400,
        }
        r = httpx.post(load, json={"lora_name": "a4"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "InvalidUserInput"
        r = httpx.post(unload, json={"lora_name": "a3"})
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'a3' removed successfully."
        assert complete(p, "a3").status_code == 404
        assert "a3" not in {c["id"] for c in httpx.get(p.url + "/v1/models").json()["data"]}
        r = httpx.post(unload, json={"lora_name": "a3"})
        assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
        # A static adapter unloads too.
        assert httpx.post(unload, json={"lora_name": "a1"}).status_code == 200
        assert complete(p, "a1").status_code == 404
        # The routes exist without --enable-lora, but loading fails as vLLM's add_lora does.
        r = httpx.post(
            off.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"}
        )
        assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"]
    finally:
        p.stop()
        off.stop()


# -- metrics and max_loras ----------------------------------------------------------------------
def test_lora_requests_info_and_max_loras_waiting(tmp_path: Path) -> None:
    p = lora_engine(tmp_path, *NAMES, *LORA, "--max-loras", "1")
    try:
        text = httpx.get(p.url + "/metrics").text
        assert "# TYPE vllm:lora_requests_info gauge" in text
        # A sample (idle) before any step: the gateway's prober asks for this series by name,
        # and a series with no sample would be left out of that page (LoRA looking off).
        assert lora_info(p)[0][1] == {
            "max_lora": "1",
            "running_lora_adapters": "",
            "waiting_lora_adapters": "",
        }
        from unbroken.gateway._adapters import parse_lora_info
        from unbroken.gateway._prober import METRICS_PATH

        assert parse_lora_info(httpx.get(p.url + METRICS_PATH).text) is not None
        s = _raw_stream(p, {"model": "a1", "prompt": "x", "max_tokens": 2000})
        results: list[httpx.Response] = []
        t = threading.Thread(target=lambda: results.append(complete(p, "a2", n=3)))
        t.start()

        def latest() -> dict[str, str]:
            return lora_info(p)[0][1]

        wait_for(
            lambda: (
                latest()
                == {
                    "max_lora": "1",
                    "running_lora_adapters": "a1",
                    "waiting_lora_adapters": "a2",
                }
            ),
            what=lambda: str(lora_info(p)),
        )
        value = lora_info(p)[0][0]
        assert abs(value - time.time()) < 5  # the value is the wall-clock time of the step
        # The base model and the running adapter are not held back by the waiting adapter.
        assert complete(p, "alias", n=3).status_code == 200
        assert complete(p, "a1", n=3).status_code == 200
        assert not results and t.is_alive()
        s.close()
        t.join(10)
        assert results[0].status_code == 200
        assert (
            results[0].json()["choices"][0]["text"]
            == expected_completion("tell me", 3, adapter="a2").text
        )
        wait_for(
            lambda: (
                latest()["running_lora_adapters"] == "" and not latest()["waiting_lora_adapters"]
            )
        )
        # Every label set seen stays exposed, each with the time it was last set.
        seen = {
            (lab["running_lora_adapters"], lab["waiting_lora_adapters"]) for _, lab in lora_info(p)
        }
        assert {("a1", "a2"), ("a2", ""), ("", "")} <= seen
        state = httpx.get(p.url + "/admin/state", headers={"Authorization": f"Bearer {TOKEN}"})
        assert state.json()["lora"]["adapters"] == {"a1": "/lora/a1", "a2": "/lora/a2"}
    finally:
        p.stop()


def test_no_lora_metric_without_enable_lora(tmp_path: Path) -> None:
    p = lora_engine(tmp_path, *NAMES)
    try:
        assert complete(p, "alias").status_code == 200
        assert "lora_requests_info" not in httpx.get(p.url + "/metrics").text
        assert complete(p, "a1").status_code == 404
    finally:
        p.stop()


# -- continuation -------------------------------------------------------------------------------
def test_an_adapter_continues_exactly_on_another_replica(tmp_path: Path) -> None:
    """What the gateway's migration does: the text so far appended to the prompt, on another
    engine with the same adapter, gives exactly the rest."""
    a = lora_engine(tmp_path, *NAMES, *LORA, "--seed", "3", name="a")
    b = lora_engine(tmp_path, *NAMES, *LORA, "--seed", "3", name="b")
    try:
        full = complete(a, "a1", "once upon", 40).json()["choices"][0]["text"]
        assert full == expected_completion("once upon", 40, seed=3, adapter="a1").text
        head = expected_completion("once upon", 17, seed=3, adapter="a1").text
        assert full.startswith(head)
        rest = complete(b, "a1", "once upon" + head, 23).json()["choices"][0]["text"]
        assert head + rest == full
        # The same continuation under another adapter or the base model diverges.
        other = complete(b, "a2", "once upon" + head, 23).json()["choices"][0]["text"]
        base = complete(b, "base", "once upon" + head, 23).json()["choices"][0]["text"]
        assert other != rest and base != rest
        # Chat: a trailing assistant message with continue_final_message.
        msgs = [{"role": "user", "content": "hi"}]
        body = {"model": "a2", "messages": msgs, "max_tokens": 30, "temperature": 0}
        whole = httpx.post(a.url + "/v1/chat/completions", json=body).json()
        whole_text = whole["choices"][0]["message"]["content"]
        part = expected_chat(msgs, 11, seed=3, adapter="a2").text
        cont = {
            **body,
            "messages": [*msgs, {"role": "assistant", "content": part}],
            "max_tokens": 19,
            "continue_final_message": True,
            "add_generation_prompt": False,
        }
        tail = httpx.post(b.url + "/v1/chat/completions", json=cont).json()
        assert part + tail["choices"][0]["message"]["content"] == whole_text
    finally:
        a.stop()
        b.stop()
