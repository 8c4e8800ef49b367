"""The simulator's deterministic model: the property every byte-exact test stands on."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.engine.textmodel import (
    VOCAB,
    StopChecker,
    TextModel,
    expected_chat,
    expected_completion,
    generate,
    render_chat,
)

prompts = st.text(min_size=0, max_size=60)


@given(prompt=prompts, total=st.integers(1, 60), cut=st.integers(0, 60), seed=st.integers(0, 9))
@settings(max_examples=200, deadline=None)
def test_any_prefix_continues_exactly(prompt: str, total: int, cut: int, seed: int) -> None:
    cut = min(cut, total)
    whole = expected_completion(prompt, total, seed=seed)
    head = expected_completion(prompt, cut, seed=seed) if cut else None
    head_text = head.text if head else ""
    rest = expected_completion(prompt + head_text, total - cut, seed=seed) if total > cut else None
    assert head_text + (rest.text if rest else "") == whole.text


@given(user=st.text(max_size=40), total=st.integers(2, 40), cut=st.integers(1, 39))
@settings(max_examples=100, deadline=None)
def test_chat_continuation_matches(user: str, total: int, cut: int) -> None:
    cut = min(cut, total - 1)
    msgs = [("system", "be brief"), ("user", user)]
    whole = expected_chat(msgs, total)
    head = expected_chat(msgs, cut)
    rest = expected_chat(
        [*msgs, ("assistant", head.text)],
        total - cut,
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert head.text + rest.text == whole.text


def test_tokens_are_vocabulary_words_joined_by_single_spaces() -> None:
    e = expected_completion("Hello", 50)
    assert e.text.startswith(" ")
    words = e.text[1:].split(" ")
    assert len(words) == 50 and all(w in VOCAB for w in words)
    assert expected_completion("Hello ", 3).text[0] != " "  # no double space


def test_seed_changes_text_and_same_seed_repeats() -> None:
    assert expected_completion("x", 20, seed=1) == expected_completion("x", 20, seed=1)
    assert expected_completion("x", 20, seed=1).text != expected_completion("x", 20, seed=2).text


def test_eos_is_deterministic_and_respects_min_tokens() -> None:
    m = TextModel(0, eos_rate=0.2)
    a = generate(m, "p", 500)
    assert a.finish_reason == "stop" and a == generate(m, "p", 500)
    b = generate(m, "p", 500, min_tokens=a.completion_tokens + 5)
    assert b.completion_tokens >= a.completion_tokens + 5
    c = generate(m, "p", 200, ignore_eos=True)
    assert c.finish_reason == "length" and c.completion_tokens == 200


def test_stop_strings_are_held_back_and_excluded() -> None:
    full = expected_completion("p", 30).text
    stop = full[40:47]
    e = expected_completion("p", 30, stop=[stop])
    assert e.finish_reason == "stop" and e.text == full[: full.index(stop)]
    chk = StopChecker([stop])
    sent = ""
    cur = TextModel().cursor("p")
    for _ in range(30):
        out, stopped = chk.add(cur.next()[0])
        sent += out
        if stopped:
            break
    assert sent == e.text


def test_chat_template_shape() -> None:
    ctx = render_chat([("user", "hi")])
    assert ctx == "<|user|>\nhi<|end|>\n<|assistant|>\n"
    ctx2 = render_chat(
        [("user", "hi"), ("assistant", "so")],
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert ctx2 == "<|user|>\nhi<|end|>\n<|assistant|>\nso"
