"""Real vLLM, a model whose output re-tokenizes canonically (only whole " word" tokens): the
migrated stream is byte-exact, and so is the text that a re-tokenizing engine would see."""

from __future__ import annotations

import signal

import pytest
from test_vllm_gateway import USAGE, chat, check_exact, comp, generating, streams
from vllmstack import Stack, references

from helpers import metric

# serial: the two vLLM servers are pinned one per core; nothing else of the run beside them
pytestmark = [pytest.mark.timeout(1500), pytest.mark.serial]


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
