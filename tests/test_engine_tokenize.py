"""vLLM's `/tokenize` and `/detokenize` on the simulator (engine/tokenize.py), straight and
through the gateway (which forwards them as they are): counts that agree with the usage the
same prompt is billed, ids that decode back to their text and that, sent as a token prompt,
are the same prompt; vLLM 0.32's answer shape and its errors. Real processes over real
sockets; the openai client for the completions compared."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from helpers import MODEL, Proc, engine, gateway
from unbroken.engine.textmodel import count_tokens, render_chat

CHAT = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "name the river Zambezi please"},
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Proc]]:
    tmp = tmp_path_factory.mktemp("tokenize")
    e = engine(tmp)
    g = gateway(tmp, e.url)
    yield e, g
    g.stop()
    e.stop()


def _urls(stack: tuple[Proc, Proc]) -> list[str]:
    return [stack[0].url, stack[1].url]


def test_a_prompt_its_count_ids_and_strings(stack: tuple[Proc, Proc]) -> None:
    max_len = httpx.get(stack[0].url + "/v1/models").json()["data"][0]["max_model_len"]
    for url in _urls(stack):
        text = "the quiet river Zambezi ran   north"
        r = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": text})
        assert r.status_code == 200, r.text
        body = r.json()
        assert set(body) == {"count", "max_model_len", "tokens", "token_strs"}
        assert body["count"] == count_tokens(text) == len(body["tokens"]) == 6
        assert body["max_model_len"] == max_len and body["token_strs"] is None
        assert all(isinstance(t, int) and t >= 0 for t in body["tokens"])
        r = httpx.post(url + "/tokenize", json={"prompt": text, "return_token_strs": True})
        assert r.json()["token_strs"] == text.split() and r.json()["tokens"] == body["tokens"]
        # Back to text, unknown words included (whitespace runs become single spaces).
        r = httpx.post(url + "/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
        assert r.status_code == 200 and r.json() == {"prompt": " ".join(text.split())}


def test_a_chat_counts_what_its_completion_is_billed(stack: tuple[Proc, Proc]) -> None:
    for url in _urls(stack):
        r = httpx.post(url + "/tokenize", json={"model": MODEL, "messages": CHAT})
        assert r.status_code == 200, r.text
        pairs = [(m["role"], m["content"]) for m in CHAT]
        assert r.json()["count"] == count_tokens(render_chat(pairs))
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        done = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3)  # type: ignore[arg-type]
        assert done.usage is not None and done.usage.prompt_tokens == r.json()["count"]
        # Without the generation prompt the template's assistant header is not counted.
        bare = httpx.post(
            url + "/tokenize",
            json={"messages": CHAT, "add_generation_prompt": False},
        ).json()["count"]
        assert bare == count_tokens(render_chat(pairs, add_generation_prompt=False))
        assert bare < r.json()["count"]


def test_ids_sent_back_as_a_token_prompt_are_the_same_prompt(stack: tuple[Proc, Proc]) -> None:
    """A prompt's ids from /tokenize, sent as a token-id prompt, write what the text wrote
    (single-spaced text: the ids carry no whitespace)."""
    url = stack[1].url
    text = "tell me of the Limpopo and its valley"
    ids = httpx.post(url + "/tokenize", json={"prompt": text}).json()["tokens"]
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    by_text = client.completions.create(model=MODEL, prompt=text, max_tokens=8, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage is not None and by_ids.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize(
    ("route", "body", "status", "words"),
    [
        ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "nope"),
        ("/tokenize", {"model": MODEL}, 400, "prompt"),
        ("/tokenize", {"prompt": 3}, 400, "prompt"),
        (
            "/tokenize",
            {"messages": CHAT, "continue_final_message": True, "add_generation_prompt": True},
            400,
            "Cannot set both",
        ),
        ("/tokenize", {"messages": "hi"}, 400, "messages"),
        ("/detokenize", {"tokens": [1, -2]}, 400, "tokens"),
        ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
        ("/detokenize", {"model": "nope", "tokens": [1]}, 404, "nope"),
        ("/detokenize", {}, 400, "tokens"),
    ],
)
def test_bad_requests_are_refused_in_openai_shape(
    stack: tuple[Proc, Proc], route: str, body: dict[str, object], status: int, words: str
) -> None:
    for url in _urls(stack):
        r = httpx.post(url + route, json=body)
        assert r.status_code == status, (url, r.text)
        err = r.json()["error"]
        assert words in err["message"] and err["type"]


def test_malformed_json_is_a_400(stack: tuple[Proc, Proc]) -> None:
    for url in _urls(stack):
        for route in ("/tokenize", "/detokenize"):
            r = httpx.post(
                url + route, content=b"{nope", headers={"Content-Type": "application/json"}
            )
            assert r.status_code == 400 and "error" in r.json()
