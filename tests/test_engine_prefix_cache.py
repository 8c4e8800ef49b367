"""The simulator's prefix cache (vLLM v1's block pool): the data structure in-process, the
timing and metrics against a real `unbroken engine` process."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import MODEL, TOKEN, engine, metric, stream
from unbroken.engine.core import EngineCore, Output, Seq
from unbroken.engine.kvcache import KVCache, root_hash
from unbroken.engine.profiles import EngineProfile
from unbroken.engine.textmodel import (
    VOCAB,
    StopChecker,
    TextModel,
    count_tokens,
    expected_completion,
    token_ids,
)

BS = 16
MODEL_TEXT = TextModel()


def _words(n: int, offset: int = 0) -> str:
    return " ".join(VOCAB[(i * 7 + offset) % len(VOCAB)] for i in range(n))


def _core(
    blocks: int = 64,
    *,
    caching: bool = True,
    outs: list[Output] | None = None,
    budget: int = 8192,
) -> EngineCore:
    prof = EngineProfile(
        "test",
        kv_capacity_tokens=blocks * BS,
        block_size=BS,
        decode_base_s=0.0,
        decode_per_seq_s=0.0,
        prefill_per_token_s=0.0,
        enable_prefix_caching=caching,
        max_num_batched_tokens=budget,
    )
    sink = outs if outs is not None else []
    return EngineCore(prof, sink.extend, cache_root=root_hash(MODEL))


def _seq(rid: str, text: str, max_tokens: int = 4, *, caching: bool = True) -> Seq:
    ids = token_ids(text) if caching else []
    return Seq(
        rid,
        0,
        count_tokens(text),
        max_tokens,
        MODEL_TEXT.cursor(text),
        StopChecker([]),
        None,
        ignore_eos=True,
        token_ids=ids,
    )


def _run(core: EngineCore, *seqs: Seq) -> int:
    """Submit and step until idle; return the prefill tokens charged."""
    prefill = [0]
    core._on_step = lambda _c, p, _n: prefill.__setitem__(0, prefill[0] + p)
    core.waiting.extend(seqs)
    while core.running or core.waiting:
        core._step()
    return prefill[0]


# -- token ids ------------------------------------------------------------------------------
def test_token_ids_are_one_per_counted_token_and_stable() -> None:
    for text in ("", " ", "a", "the of", " the  of\n", "<|user|>\nhi<|end|>\n", "é ü 中"):
        assert len(token_ids(text)) == count_tokens(text), text
    assert token_ids("the of and") == [0, 1, 2]  # vocabulary words: their index
    odd = token_ids("zebra the")
    assert odd[1] == 0 and odd[0] >= 2**31  # others: CRC-32 with the top bit, never a word's
    assert token_ids("zebra") == [odd[0]]


def test_token_ids_of_4000_tokens_cost_well_under_a_millisecond() -> None:
    text = _words(3000) + " " + " ".join(f"w{i}" for i in range(1000))
    token_ids(text)
    costs = []
    for _ in range(20):
        t = time.perf_counter()
        token_ids(text)
        costs.append(time.perf_counter() - t)
    kv = KVCache(512, BS)
    s = _seq("x", text)
    t = time.perf_counter()
    kv.lookup(s, s.num_tokens)  # hashes all 250 blocks
    hashing = time.perf_counter() - t
    # Measured on the 2-core VM: ~0.2 ms ids (a quarter of the words unknown), ~0.1 ms hashes.
    assert statistics.median(costs) < 0.002 and hashing < 0.002, (costs, hashing)


# -- the block pool -------------------------------------------------------------------------
def test_shared_prefix_hits_whole_blocks_and_prefills_only_the_rest() -> None:
    core = _core()
    prefix = _words(100)
    a = _seq("a", prefix + " " + _words(10, 1))
    assert _run(core, a) == 110
    assert (core.kv.queries, core.kv.hits) == (110, 0)
    b = _seq("b", prefix + " " + _words(30, 2))
    assert _run(core, b) == 130 - 96  # 6 full blocks of the 100 shared tokens
    assert (core.kv.queries, core.kv.hits) == (240, 96) and b.cached_tokens == 96
    c = _seq("c", _words(100, 3))  # a different prefix misses
    assert _run(core, c) == 100
    assert core.kv.hits == 96
    core.kv.check([])
    assert core.kv_usage == 0.0  # cached blocks nobody holds count as free (vLLM)
    assert len(core.kv.cached) > 0


def test_an_identical_prompt_recomputes_its_last_token_block() -> None:
    core = _core()
    text = _words(64)  # exactly 4 blocks
    _run(core, _seq("a", text))
    prefill = _run(core, _seq("b", text))
    # vLLM: max_cache_hit_length = n - 1, so the 4th block is computed again.
    assert prefill == 16 and core.kv.hits == 48


def test_other_models_and_disabled_caching_never_hit() -> None:
    text = _words(80)
    kv = KVCache(64, BS, root=root_hash(MODEL))
    a = _seq("a", text)
    kv.admit(a, kv.lookup(a, 80), kv.blocks_for(81))
    kv.cache_full(a, 80)
    kv.release(a)
    assert len(kv.lookup(_seq("same", text), 80)) == 4
    kv.root = root_hash("another-model")  # the model name is the root of every chain
    assert kv.lookup(_seq("other", text), 80) == []
    off = _core(caching=False)
    assert _run(off, _seq("a", text, caching=False)) == 80
    assert _run(off, _seq("b", text, caching=False)) == 80
    assert (off.kv.queries, off.kv.hits, len(off.kv.cached)) == (0, 0, 0)


def test_eviction_is_least_recently_freed_first() -> None:
    # 12 blocks; each prompt is 3 full blocks + 2 tokens and 1 generated token: 4 blocks.
    core = _core(blocks=12)
    prompts = {k: _words(50, k) for k in range(4)}
    for k in (0, 1, 2):
        _run(core, _seq(f"p{k}", prompts[k], max_tokens=1))
    assert core.kv.evictions == 0 and len(core.kv.cached) == 9
    _run(core, _seq("again0", prompts[0], max_tokens=1))  # p0's blocks: now most recent
    assert core.kv.hits == 48
    _run(core, _seq("p3", prompts[3], max_tokens=1))  # needs 4 blocks: evicts from p1
    assert core.kv.evictions == 3  # p1's three full blocks, the least recently freed
    hits = core.kv.hits
    assert _run(core, _seq("p0", prompts[0], max_tokens=1)) == 2  # still cached
    assert _run(core, _seq("p2", prompts[2], max_tokens=1)) == 2  # still cached
    assert core.kv.hits == hits + 96
    assert _run(core, _seq("p1", prompts[1], max_tokens=1)) == 50  # evicted
    core.kv.check([])


def test_eviction_frees_a_requests_tail_before_its_head() -> None:
    core = _core(blocks=8)
    long = _words(100)  # 7 blocks with its first output token
    _run(core, _seq("long", long, max_tokens=1))
    # 3 blocks: the never-used one, long's partial last block, then its 6th full block.
    _run(core, _seq("small", _words(40, 5), max_tokens=1))
    assert core.kv.evictions == 1
    assert _run(core, _seq("long2", long, max_tokens=1)) == 100 - 80  # 5 head blocks left


def test_siblings_admitted_together_share_the_prompt() -> None:
    core = _core()
    text = _words(70)
    seqs = [_seq("r", text) for _ in range(3)]
    for i, s in enumerate(seqs):
        s.index = i
    prefill = _run(core, *seqs)
    assert prefill == 70 + 2 * (70 - 64)
    assert core.kv.hits == 2 * 64


def test_preempted_sequences_release_and_come_back_through_the_cache() -> None:
    outs: list[Output] = []
    core = _core(blocks=10, outs=outs)
    seqs = [_seq(f"s{i}", _words(30, i), max_tokens=60) for i in range(3)]
    _run(core, *seqs)
    assert core.preemptions >= 1
    texts: dict[str, str] = {}
    for o in outs:
        texts[o.seq.request_id] = texts.get(o.seq.request_id, "") + o.text
    for i in range(3):  # recomputation changes nothing
        assert texts[f"s{i}"] == expected_completion(_words(30, i), 60, ignore_eos=True).text
    core.kv.check([])
    assert core.kv.num_free == 10


def test_a_sequence_longer_than_the_cache_ends_instead_of_spinning() -> None:
    outs: list[Output] = []
    core = _core(blocks=2, outs=outs)
    _run(core, _seq("big", _words(40), max_tokens=5))
    assert outs[-1].finish_reason == "length"
    outs.clear()
    _run(core, _seq("grows", _words(20), max_tokens=50))
    assert outs[-1].finish_reason == "length" and 0 < sum(o.tokens for o in outs) < 50
    core.kv.check([])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("submit"), st.integers(0, 5), st.integers(1, 60), st.integers(1, 3)),
            st.tuples(st.just("abort"), st.integers(0, 40)),
            st.tuples(st.just("step"), st.integers(1, 4)),
        ),
        max_size=60,
    ),
    st.integers(4, 24),
)
def test_accounting_never_leaks(ops: list[tuple], blocks: int) -> None:
    """Random submits (shared prefixes, n up to 3), aborts and steps: every block is held by
    exactly the running sequences that reference it, or free; all free once all finish."""
    core = _core(blocks=blocks)
    ids: list[str] = []
    for op in ops:
        if op[0] == "submit":
            _, family, length, n = op
            rid = f"r{len(ids)}"
            ids.append(rid)
            text = _words(8 * family, family) + " " + _words(length, 99)
            seqs = [_seq(rid, text, max_tokens=1 + length % 17) for _ in range(n)]
            for i, s in enumerate(seqs):
                s.index = i
            core.waiting.extend(seqs)
        elif op[0] == "abort" and ids:
            core._drop({ids[op[1] % len(ids)]})
        else:
            for _ in range(op[1]):
                core._step()
        core.kv.check(core.running)
        assert all(not s.blocks for s in core.waiting)
        assert 0.0 <= core.kv_usage <= 1.0
    while core.running or core.waiting:
        core._step()
        core.kv.check(core.running)
    assert core.kv.num_free == blocks and core.kv_usage == 0.0


# -- generated tokens and chunked prefill (vLLM v1's scheduler) ---------------------------
def test_a_finished_requests_reply_stays_cached_for_the_next_turn() -> None:
    """vLLM caches every full block a request computed, its output's too: the next turn's
    prompt (prompt + reply + new message) hits all of it but the last sampled token, whose
    KV was never computed."""
    outs: list[Output] = []
    core = _core(outs=outs)
    first = _words(50)
    _run(core, _seq("t1", first, max_tokens=40))
    reply = "".join(o.text for o in outs)
    assert len(reply.split()) == 40
    # 50 prompt tokens + 39 of the reply computed: 5 full blocks; 6 once a block of the
    # prompt alone would have been 3.
    second = f"{first} {reply} {_words(10, 4)}"
    prefill = _run(core, _seq("t2", second))
    assert core.kv.hits == 80 and prefill == 100 - 80


def test_a_long_prefill_is_chunked_by_the_token_budget_and_decodes_go_on() -> None:
    """max_num_batched_tokens bounds a step: running decodes take their one token first,
    a new prompt gets the rest of the budget each step and its first token comes with its
    last chunk; the decoder gets a token in every one of those steps."""
    outs: list[Output] = []
    core = _core(blocks=1024, outs=outs, budget=512)
    steps: list[tuple[int, int]] = []
    core._on_step = lambda _c, p, n: steps.append((p, n))
    core.waiting.append(_seq("decoder", _words(20), max_tokens=30))
    core._step()  # the decoder's prefill: 20 tokens, its first token
    core.waiting.append(_seq("long", _words(1500, 1), max_tokens=2))
    while core.running or core.waiting:
        core._step()
    # Each step while "long" prefills: the decoder's token (budget 511 left) and a chunk.
    assert steps[:4] == [(20, 1), (511, 1), (511, 1), (478, 2)], steps[:5]
    firsts = [i for i, o in enumerate(outs) if o.seq.request_id == "long"]
    assert len(firsts) == 2 and outs[firsts[0]].tokens == 1
    assert sum(p for p, _ in steps) == 20 + 1500  # every prompt token computed once
    core.kv.check([])


def test_a_steps_time_grows_with_the_prefill_it_carries_for_everyone() -> None:
    """The step that prefills a new prompt is every running sequence's step too: its time
    is the decode cost plus the prefill tokens' (and no more than the budget's worth)."""
    prof = EngineProfile(
        "t",
        decode_base_s=0.010,
        decode_per_seq_s=0.001,
        prefill_per_token_s=40e-6,
        max_num_batched_tokens=2048,
    )
    core = EngineCore(prof, lambda _o: None, cache_root=root_hash(MODEL))
    spent: list[float] = []
    core._spend = lambda seconds, _prefill: spent.append(seconds)  # type: ignore[method-assign]
    core.waiting.append(_seq("a", _words(8), max_tokens=20))
    core._step()
    core._step()  # a decode step: 10 ms + 1 ms
    core.waiting.append(_seq("b", _words(3000, 2), max_tokens=2))
    core._step()  # a's decode and 2,047 of b's tokens
    core._step()  # a's decode and the other 953
    assert [round(x * 1e3, 2) for x in spent] == [11.32, 11.0, 93.88, 50.12]


# -- a real engine --------------------------------------------------------------------------
def _ttft(url: str, prompt: str) -> float:
    t0 = time.monotonic()
    events, r = stream(url, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2})
    assert r.status_code == 200 and events[-1] == "[DONE]"
    return time.monotonic() - t0  # the first event comes with the first token


def test_a_cached_prefix_cuts_ttft_and_is_counted(tmp_path: Path) -> None:
    # 100 µs per prefilled token: 2,000 tokens cost 200 ms, a 16-token remainder 1.6 ms.
    p = engine(tmp_path, "--prefill-per-token-s", "0.0001")
    try:
        prefix = _words(2000)
        first = _ttft(p.url, prefix + " alpha")
        assert metric(p.url, "vllm:prefix_cache_hits_total") == 0
        assert metric(p.url, "vllm:prefix_cache_queries_total") == 2001
        second = _ttft(p.url, prefix + " beta gamma")
        hits = metric(p.url, "vllm:prefix_cache_hits_total")
        assert hits == 2000  # 125 whole blocks of the shared 2,000 tokens
        assert metric(p.url, "vllm:prefix_cache_queries_total") == 2001 + 2002
        assert first > 0.18 and second < first - 0.12, (first, second)
        third = _ttft(p.url, _words(2000, 3))  # another prefix misses
        assert metric(p.url, "vllm:prefix_cache_hits_total") == hits and third > 0.18
        # Finished requests hold nothing: cached blocks count as free, as in vLLM.
        assert metric(p.url, "vllm:kv_cache_usage_perc") == 0.0
        text = httpx.get(p.url + "/metrics").text
        for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
            assert f'{name}{{engine="0",model_name="{MODEL}"}}' in text
        state = httpx.get(
            p.url + "/admin/state", headers={"Authorization": f"Bearer {TOKEN}"}
        ).json()["kv_cache"]
        assert state["block_size"] == 16 and state["prefix_cache_hits"] == 2000
        assert state["cached_blocks"] >= 250 and state["free_blocks"] == state["blocks"]
    finally:
        p.stop()


def test_chat_prompts_hit_on_the_rendered_template(tmp_path: Path) -> None:
    p = engine(tmp_path)
    try:
        system = {"role": "system", "content": _words(200)}
        for q in ("first question", "second question"):
            body = {
                "model": MODEL,
                "messages": [system, {"role": "user", "content": q}],
                "max_tokens": 3,
            }
            r = httpx.post(p.url + "/v1/chat/completions", json=body, timeout=30)
            assert r.status_code == 200
        # "<|system|>", 200 words (the last glued to "<|end|>"), "<|user|>": 202 shared
        # tokens, 12 whole blocks.
        assert metric(p.url, "vllm:prefix_cache_hits_total") == 192
    finally:
        p.stop()


def test_a_chat_turn_hits_the_previous_turns_reply(tmp_path: Path) -> None:
    """Over HTTP with the chat template: turn 2 carries turn 1's actual reply, and the
    engine finds the blocks of that reply (generated tokens) in its cache, not only the
    prompt's."""
    p = engine(tmp_path)
    try:
        msgs = [
            {"role": "system", "content": _words(200)},
            {"role": "user", "content": _words(9, 5)},
        ]
        body = {"model": MODEL, "messages": msgs, "max_tokens": 30}
        r = httpx.post(p.url + "/v1/chat/completions", json=body, timeout=30)
        reply = r.json()["choices"][0]["message"]["content"]
        assert len(reply.split()) == 30
        msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": "more"}]
        r = httpx.post(p.url + "/v1/chat/completions", json={**body, "messages": msgs}, timeout=30)
        assert r.status_code == 200
        # Turn 1 computed its 212 prompt tokens ("<|system|>", 200 words, "<|user|>", 9
        # words, "<|assistant|>"; a message's last word is glued to "<|end|>") and 29 of
        # its reply (the 30th was sampled, never fed back): 241 tokens, 15 whole blocks.
        # Without the reply's blocks it would be 13 (208 tokens).
        assert metric(p.url, "vllm:prefix_cache_hits_total") == 240
    finally:
        p.stop()


def test_max_num_batched_tokens_is_vllms_flag_and_chunks_the_prefill(tmp_path: Path) -> None:
    """`unbroken engine --max-num-batched-tokens 512` (vLLM's flag): a 2,000-token prompt
    takes four steps to its first token (512 x 3 + 464), not one."""
    p = engine(tmp_path, "--max-num-batched-tokens", "512")
    try:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        before = httpx.get(p.url + "/admin/state", headers=auth).json()["steps"]
        body = {"model": MODEL, "prompt": _words(2000), "max_tokens": 1}
        r = httpx.post(p.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1
        assert httpx.get(p.url + "/admin/state", headers=auth).json()["steps"] - before == 4
    finally:
        p.stop()


def test_cache_salt_keeps_prompts_apart_and_is_checked_as_vllm(tmp_path: Path) -> None:
    """vLLM keys a salted prompt's first block by its `cache_salt`: the same prompt under
    another salt (or none) shares nothing; the same salt shares as usual. A salt that is not
    a non-empty string of at most 128 characters without '@', '/', '\\' or NUL is a 400."""
    p = engine(tmp_path)

    def post(salt: object = None, **more: object) -> httpx.Response:
        body: dict[str, object] = {"model": MODEL, "prompt": _words(200), "max_tokens": 2}
        if salt is not None:
            body["cache_salt"] = salt
        return httpx.post(p.url + "/v1/completions", json={**body, **more}, timeout=30)

    try:
        hits = lambda: metric(p.url, "vllm:prefix_cache_hits_total")  # noqa: E731
        assert post("a").status_code == 200 and hits() == 0
        assert post("b").status_code == 200 and hits() == 0  # another salt
        assert post().status_code == 200 and hits() == 0  # no salt
        assert post("a").status_code == 200 and hits() == 192  # its own salt: 12 blocks
        for bad in ("", "x" * 129, "a/b", "a@b", "a\\b", 7):
            r = post(bad)
            assert r.status_code == 400 and "cache_salt" in r.json()["error"]["message"], bad
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        r = httpx.post(p.url + "/v1/chat/completions", json={**chat, "cache_salt": ""})
        assert r.status_code == 400
        r = httpx.post(
            p.url + "/v1/responses", json={"model": MODEL, "input": "hi", "cache_salt": 1}
        )
        assert r.status_code == 400
    finally:
        p.stop()


def test_text_parts_are_joined_with_a_newline_as_vllm(tmp_path: Path) -> None:
    """vLLM's chat utils join a message's text parts with "\\n": the parts ["a", "b"] are
    the prompt "a\\nb", the same answer byte for byte."""
    p = engine(tmp_path)
    try:

        def chat(content: object) -> str:
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": content}],
                "max_tokens": 8,
                "temperature": 0,
            }
            r = httpx.post(p.url + "/v1/chat/completions", json=body, timeout=30)
            assert r.status_code == 200, r.text
            return str(r.json()["choices"][0]["message"]["content"])

        parts = [{"type": "text", "text": "north wind"}, {"type": "text", "text": "blows"}]
        assert chat(parts) == chat("north wind\nblows") != chat("north windblows")
    finally:
        p.stop()
