"""Cache- and session-aware routing (gateway/_prefix.py, _affinity.py, _routing.py) and the
SLO-aware spill (_latency.py): the arithmetic in process on tables of cases, then a real
gateway with two worker processes in front of two real engines."""

from __future__ import annotations

import random
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers import MODEL, Proc, admin, engine, gateway, metric, ready_endpoint, wait_for
from unbroken.config.spec import GatewaySettings
from unbroken.engine.textmodel import VOCAB
from unbroken.gateway._affinity import AffinitySettings, CacheAware, home
from unbroken.gateway._latency import LatencyAware, LatencySettings
from unbroken.gateway._pool import Endpoint, PickRequest, Pool
from unbroken.gateway._prefix import PrefixIndex, RouteHint, hint_of, prompt_text
from unbroken.gateway._routing import POLICIES, PowerOfTwo, Random, RoundRobin, make_policy

_ep = ready_endpoint


def _words(n: int, seed: int) -> str:
    r = random.Random(seed)
    return " ".join(r.choice(VOCAB) for _ in range(n))


def _hint(prompt: str, session: str | None = None) -> RouteHint:
    return hint_of({"prompt": prompt}, False, "m", block_chars=64, session=session)


def _req(hint: RouteHint | None, priority: str = "standard") -> PickRequest:
    return PickRequest("m", priority, hint)


# -- block names and the index ------------------------------------------------------------------
def test_block_names_are_chained_and_the_same_in_every_process() -> None:
    """Equal prefixes give equal leading names, a changed character changes every name after
    it, and the names do not depend on the process (CRC-32, not Python's salted hash)."""
    text = _words(400, 1)
    a = _hint(text)
    b = _hint(text[:1000] + "X" + text[1001:])
    assert a.blocks[:15] == b.blocks[:15]  # the change is in block 15 (chars 960-1023)
    assert all(x != y for x, y in zip(a.blocks[15:], b.blocks[15:], strict=False))
    assert len(a.blocks) == len(text.encode()) // 64
    assert (
        a.blocks[:2]
        == hint_of({"prompt": text}, False, "m", block_chars=64, session=None).blocks[:2]
    )
    # Another model never shares a block, even with the same text.
    assert not set(a.blocks) & set(
        hint_of({"prompt": text}, False, "other", block_chars=64, session=None).blocks
    )


def test_a_huge_prompt_costs_a_bounded_number_of_blocks() -> None:
    """An 8 MiB prompt (the default body limit) is named up to MAX_HASHED_BYTES only; its
    length still counts in full for the prefill estimate."""
    from unbroken.gateway._prefix import MAX_HASHED_BYTES

    h = _hint("word " * (8 * 2**20 // 5))
    assert len(h.blocks) == MAX_HASHED_BYTES // 64
    assert h.chars > 8_000_000


@pytest.mark.parametrize("block_chars", [8, 16, 64, 100])
def test_block_names_asked_one_by_one_equal_the_chained_loop(block_chars: int) -> None:
    """A pick asks a few names in binary-search order (`BlockNames`, one crc32 call from the
    nearest name known below): in any order, each is the name the block-by-block chain
    gives, and so are slices, iteration and the whole list afterwards."""
    import zlib

    r = random.Random(block_chars)
    for _ in range(40):
        text = "".join(r.choice("ab cé") for _ in range(r.randint(0, 3000)))
        data, h, want = text.encode(), zlib.crc32(b"m"), []
        for i in range(0, len(data) - block_chars + 1, block_chars):
            h = zlib.crc32(data[i : i + block_chars], h)
            want.append(h)
        got = hint_of({"prompt": text}, False, "m", block_chars=block_chars, session=None).blocks
        assert len(got) == len(want)
        order = list(range(len(want)))
        r.shuffle(order)
        for i in order[:25]:
            assert got[i] == want[i]
            assert got[i - len(want)] == want[i]  # negative indices too
        with pytest.raises(IndexError):
            got[len(want)]
        assert got[:3] == want[:3] and list(got) == want and got == want


def test_chat_prompt_text_keeps_message_prefixes_as_text_prefixes() -> None:
    """A conversation's next turn carries the previous one: its text starts with the
    previous turn's text, so its blocks start with the previous turn's blocks."""
    turn1 = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    turn2 = [*turn1, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "more"}]
    t1, t2 = prompt_text({"messages": turn1}, True), prompt_text({"messages": turn2}, True)
    assert t2.startswith(t1)
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    # vLLM joins a message's text parts with a newline: the same prompt as the joined string
    assert prompt_text({"messages": parts}, True) == "user\na\nb\x1e"
    assert prompt_text({"messages": parts}, True) == prompt_text(
        {"messages": [{"role": "user", "content": "a\nb"}]}, True
    )
    assert prompt_text({"prompt": ["first", "second"]}, False) == "first"
    assert prompt_text({"prompt": [1, 2, 3]}, False) == "1 2 3"


@pytest.mark.parametrize(
    ("recorded", "asked", "held"),
    [
        (40, 40, 40),  # all of it
        (40, 25, 25),  # a shorter prompt of the same prefix
        (10, 40, 10),  # a longer one: the leading run
        (0, 40, 0),
        (1, 40, 1),
    ],
)
def test_index_finds_the_leading_run(recorded: int, asked: int, held: int) -> None:
    text = _words(800, 2)
    blocks = _hint(text).blocks
    idx = PrefixIndex()
    idx.record("a", blocks[:recorded])
    assert idx.cached("a", blocks[:asked]) == held
    assert idx.cached("b", blocks[:asked]) == 0


def test_index_is_bounded_and_evicts_least_recently_used() -> None:
    idx = PrefixIndex(blocks_per_endpoint=100)
    old, new = _hint(_words(1200, 3)).blocks[:60], _hint(_words(1200, 4)).blocks[:60]
    idx.record("a", old)
    idx.record("a", new)  # 120 > 100: the oldest 20 of `old` go: its tail
    assert idx.size() == 100
    assert idx.cached("a", new) == 60
    assert idx.cached("a", old) == 40  # its head stays a leading run
    idx.forget("a")
    assert idx.size() == 0


# -- the policy ---------------------------------------------------------------------------------
def test_a_prompt_goes_where_its_prefix_was_sent_at_equal_load() -> None:
    pol = CacheAware()
    a, b, c = _ep("a"), _ep("b"), _ep("c")
    system = _words(600, 5)
    first = _req(_hint(system + " question one"))
    ep = pol.pick([a, b, c], first)
    assert ep is not None
    pol.on_admit(ep, first)
    for q in ("two", "three", "four"):
        assert pol.pick([a, b, c], _req(_hint(system + f" question {q}"))) is ep
    # An unrelated prompt is not drawn there by the index.
    others = Counter(
        pol.pick([a, b, c], _req(_hint(_words(600, 100 + i)))).name  # type: ignore[union-attr]
        for i in range(30)
    )
    assert len(others) == 3  # spread by their own homes


def test_load_outweighs_a_short_prefix_but_not_a_long_one() -> None:
    """One decision: the prefill saved is weighed against the load, not a threshold."""
    pol = CacheAware()
    a, b = _ep("a", inflight=2), _ep("b", inflight=0)
    short, long_ = _words(30, 6), _words(3000, 7)
    for text in (short, long_):
        pol.on_admit(a, _req(_hint(text)))
    assert pol.pick([a, b], _req(_hint(short + " next"))) is b  # 2 in flight beat ~40 tokens
    assert pol.pick([a, b], _req(_hint(long_ + " next"))) is a  # ~4,500 tokens of prefill


def _hot_picks(pol: Any, a: Endpoint, b: Endpoint, n: int) -> list[str]:
    """`n` requests of one popular 3,000-word prefix, `a` holding it, each stream kept open:
    where each went."""
    hot = _words(3000, 8)
    pol.on_admit(a, _req(_hint(hot)))
    picks = []
    for i in range(n):
        ep = pol.pick([a, b], _req(_hint(hot + f" q{i}")))
        assert ep is not None
        ep.slot.add(1)  # the stream stays open
        pol.on_admit(ep, _req(_hint(hot + f" q{i}")))
        picks.append(ep.name)
    return picks


def test_a_hot_prefix_does_not_pile_onto_one_replica() -> None:
    """Bounded load: past min load x 1.25 + 8, the holder gets no credit, so a popular
    prefix spreads once its holder is busy (the 'death spiral' of pure affinity)."""
    a, b = _ep("a"), _ep("b")
    picks = _hot_picks(CacheAware(), a, b, 40)
    assert picks[:9] == ["a"] * 9  # affinity while within the bound
    assert abs(a.inflight - b.inflight) <= 10  # and then both take it
    assert b.inflight >= 15


@pytest.mark.parametrize(("abs_", "rel", "first"), [(8.0, 0.25, 9), (4.0, 0.25, 5), (0.0, 0.0, 1)])
def test_the_hot_spot_guard_is_a_setting(abs_: float, rel: float, first: int) -> None:
    """`prefix_balance_abs` / `_rel` (the part vllm-router's balance thresholds play): the
    holder keeps the prefix while its load is within min x (1 + rel) + abs."""
    pol = make_policy(
        GatewaySettings(routing="prefix", prefix_balance_abs=abs_, prefix_balance_rel=rel)
    )
    picks = _hot_picks(pol, _ep("a"), _ep("b"), 30)
    assert picks[:first] == ["a"] * first and picks[first] == "b", picks


def test_session_home_is_rendezvous_and_moves_only_with_its_replica() -> None:
    pol = CacheAware(affinity=AffinitySettings(use_prefix=False))
    eps = [_ep(n) for n in "abcd"]
    sessions = [f"user-{i}" for i in range(200)]
    before = {s: pol.pick(eps, _req(_hint("hi", session=s))) for s in sessions}
    assert len({e.name for e in before.values() if e}) == 4  # spread over all replicas
    for s in sessions[:20]:  # the same session, the same replica
        assert pol.pick(eps, _req(_hint("another turn", session=s))) is before[s]
    gone = eps[1]
    after = {
        s: pol.pick([e for e in eps if e is not gone], _req(_hint("hi", session=s)))
        for s in sessions
    }
    moved = [s for s in sessions if after[s] is not before[s]]
    assert moved and all(before[s] is gone for s in moved)  # only the removed one's sessions
    assert home(b"user-1", eps) is before["user-1"]


def test_session_affinity_gives_way_to_load() -> None:
    pol = CacheAware(affinity=AffinitySettings(use_prefix=False))
    a, b = _ep("a"), _ep("b")
    s = next(f"s{i}" for i in range(100) if home(f"s{i}".encode(), [a, b]) is a)
    assert pol.pick([a, b], _req(_hint("x", session=s))) is a
    a.slot.add(20)  # far past the bound: its home is busy
    assert pol.pick([a, b], _req(_hint("x", session=s))) is b


@pytest.mark.parametrize("full", ["kv", "queue"])
def test_a_session_home_without_room_in_its_engine_gets_no_credit(full: str) -> None:
    """Bounded in-flight is not room: a few long conversations fill a replica's KV cache
    (the engine then queues new turns or preempts running ones; the routing benchmark's
    `session` rows had p99s of 0.2-0.9 s). A home whose engine reports its KV cache at
    least `session_kv_room` full, or requests waiting, gets no credit: the turn goes where
    it costs least, and comes home again once there is room."""
    pol = CacheAware(affinity=AffinitySettings(use_prefix=False))
    a, b = _ep("a"), _ep("b")
    s = next(f"s{i}" for i in range(100) if home(f"s{i}".encode(), [a, b]) is a)
    turn = "a long conversation " * 200
    assert pol.pick([a, b], _req(_hint(turn, session=s))) is a
    # `b` about as loaded as `a` is by its KV use or queue: credit would decide.
    if full == "kv":
        a.kv_usage = 0.95
        b.slot.add(3)
    else:
        a.waiting = 2
        b.slot.add(1)
    assert pol.pick([a, b], _req(_hint(turn, session=s))) is b
    a.kv_usage, a.waiting = 0.5, 0
    assert pol.pick([a, b], _req(_hint(turn, session=s))) is a


def test_session_homes_are_bounded_to_a_share_of_the_mean_load() -> None:
    """Consistent hashing with bounded loads: sessions whose rendezvous home is `a`,
    arriving one after another and staying (closed loop), do not all pile on `a`; it keeps at
    most (1 + balance_rel) x the mean in flight, well under the 8 extra streams of the older
    bound, and the sessions homed elsewhere keep their home."""
    pol = CacheAware(affinity=AffinitySettings(use_prefix=False))
    a, b, c = _ep("a"), _ep("b"), _ep("c")
    eps = [a, b, c]
    mine = [s for s in (f"s{i}" for i in range(1000)) if home(s.encode(), eps) is a][:30]
    for s in mine[:12]:
        got = pol.pick(eps, _req(_hint("a long conversation " * 200, session=s)))
        assert got is not None
        got.slot.add(1)  # the stream runs on
    # 12 sessions, mean 4 in flight: the home stops at 5 (the older bound, the least load
    # x 1.25 + 8, let it take 10 of the 12: 10, 1, 1).
    assert a.inflight <= 4 * 1.25 + 1, [e.inflight for e in eps]
    other = next(s for s in (f"t{i}" for i in range(1000)) if home(s.encode(), eps) is b)
    assert pol.pick(eps, _req(_hint("a long conversation " * 200, session=other))) is b


def test_a_session_home_with_a_stream_open_still_has_room() -> None:
    """Three replicas, one stream open on a session's home and nothing elsewhere: a turn
    carrying a long history goes home (the bound used to be max(1, mean x 1.25), under which
    that home was "full" and got no credit, and a review saw 10 of 24 turns of 6 users
    move)."""
    pol = CacheAware(affinity=AffinitySettings(use_prefix=False))
    a, b, c = _ep("a"), _ep("b"), _ep("c")
    eps = [a, b, c]
    _s1, s2 = [s for s in (f"s{i}" for i in range(1000)) if home(s.encode(), eps) is a][:2]
    a.slot.add(1)  # the first session's stream runs on
    history = _words(2000, 5)  # ~80 ms of prefill that only the home holds
    for _ in range(3):
        assert pol.pick(eps, _req(_hint(history, session=s2))) is a


def test_session_keeps_short_turns_home_unless_home_is_clearly_slower() -> None:
    """Under `session` a home with room is chosen while its expected first token is within
    1.5x the soonest candidate's, whatever the loads: `(load + 1) x expected` alone sent a
    short turn from a home with two streams to an idle replica (a review: 6-10 of 24 turns
    of 6 chat users moved; 0-2 with this). A home whose first tokens come clearly later
    (here its measured first event 200 ms against the others' floor) is left to cost."""
    pol = CacheAware(affinity=AffinitySettings(use_prefix=False))
    a, b, c = _ep("a"), _ep("b"), _ep("c")
    eps = [a, b, c]
    s = next(s for s in (f"s{i}" for i in range(1000)) if home(s.encode(), eps) is a)
    a.slot.add(2)
    for _ in range(3):
        assert pol.pick(eps, _req(_hint("a short turn", session=s))) is a
    for e, ttfb in ((a, 0.2), (b, 0.03), (c, 0.03)):
        e.latency.first_event(object(), ttfb)
    assert pol.pick(eps, _req(_hint("a short turn", session=s))) is not a
    # `prefix` keeps the session a prior only: the same short turn goes by cost.
    pre = make_policy(GatewaySettings())
    fresh = [_ep("a"), _ep("b"), _ep("c")]
    fresh[0].slot.add(2)
    assert pre.pick(fresh, _req(_hint("a short turn", session=s))) is not fresh[0]


def test_prompt_cache_key_names_a_session_after_the_header_and_before_user() -> None:
    """OpenAI's client recommends `prompt_cache_key` in place of `user` "to maintain caching
    optimizations"; a client following it must keep its affinity."""

    def session(
        raw: dict[str, object], header: str | None = None, user: str | None = None
    ) -> str | None:
        return hint_of(raw, True, "m", block_chars=64, session=header, user_header=user).session

    msgs = [{"role": "user", "content": "hi"}]
    assert session({"messages": msgs, "prompt_cache_key": "k", "user": "u"}) == "k"
    assert session({"messages": msgs, "user": "u"}) == "u"
    assert session({"messages": msgs, "prompt_cache_key": "k"}, header="h") == "h"
    assert session({"messages": msgs, "prompt_cache_key": 5, "user": "u"}) == "u"
    assert session({"messages": msgs, "prompt_cache_key": ""}) is None
    # vllm-router's X-User-ID: after everything the body names.
    assert session({"messages": msgs}, user="x") == "x"
    assert session({"messages": msgs, "user": "u"}, user="x") == "u"
    assert session({"messages": msgs}, header="h", user="x") == "h"


def test_tools_and_media_name_blocks_as_the_engine_keys_them() -> None:
    """vLLM renders `tools` into the prompt (most templates at its top) and keys an image's
    blocks by the image's hash: requests that differ only there must not look cached, and
    equal ones must."""
    msgs = [{"role": "system", "content": _words(120, 3)}, {"role": "user", "content": "go"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    other = {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}}

    def blocks(raw: dict[str, object]) -> list[int]:
        return list(hint_of(raw, True, "m", block_chars=64, session=None).blocks)

    plain = blocks({"messages": msgs})
    with_f = blocks({"messages": msgs, "tools": [tool]})
    assert with_f != plain and with_f[0] != plain[0]
    assert blocks({"messages": msgs, "tools": [tool]}) == with_f
    assert blocks({"messages": msgs, "tools": [other]})[0] != with_f[0]
    # Key order inside a tool is not content: the same tool, keys reordered, is the same.
    reordered = {"function": {"parameters": {"type": "object"}, "name": "f"}, "type": "function"}
    assert blocks({"messages": msgs, "tools": [reordered]}) == with_f

    def image(url: str) -> list[dict[str, object]]:
        part = {"type": "image_url", "image_url": {"url": url}}
        return [*msgs[:1], {"role": "user", "content": [part, {"type": "text", "text": "what?"}]}]

    one, two = blocks({"messages": image("data:a")}), blocks({"messages": image("data:b")})
    assert one == blocks({"messages": image("data:a")})
    shared = len(_words(120, 3)) // 64  # the system prompt's whole blocks
    assert one[:shared] == two[:shared] and one[-1] != two[-1]
    # An assistant turn's tool calls are part of the history the next turn carries.
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    t1 = [*msgs, {"role": "assistant", "content": None, "tool_calls": [call]}]
    t2 = [*msgs, {"role": "assistant", "content": None, "tool_calls": [{**call, "id": "c2"}]}]
    assert prompt_text({"messages": t1}, True) != prompt_text({"messages": t2}, True)


def test_prefix_routing_places_conversations_by_load_and_keeps_them_by_history() -> None:
    """`prefix` (the default): a session key is only a prior. Conversations whose sessions
    all hash to `a` start where load is least, not all on `a` (the hash's uneven share of
    long conversations filled one replica's KV cache), and each next turn, carrying the
    history, goes where its history is, its session's home or not."""
    pol = make_policy(GatewaySettings())
    assert isinstance(pol, CacheAware) and pol.a.session_blocks == pol.a.home_blocks
    a, b, c = _ep("a"), _ep("b"), _ep("c")
    eps = [a, b, c]
    mine = [s for s in (f"s{i}" for i in range(1000)) if home(s.encode(), eps) is a][:9]
    system = _words(200, 60)
    first: dict[str, str] = {}
    for i, s in enumerate(mine):
        turn = _req(_hint(f"{system} {_words(70, i)}", session=s))
        got = pol.pick(eps, turn)
        assert got is not None
        got.slot.add(1)  # the stream runs on
        pol.on_admit(got, turn)
        first[s] = got.name
    assert [e.inflight for e in eps] == [3, 3, 3]  # by load, though every home is `a`
    for e in eps:
        e.slot.add(-3)
    for i, s in enumerate(mine):  # the next turn: the same prompt, a reply and a question
        prompt = f"{system} {_words(70, i)} {_words(215, 7)} {_words(70, 8)}"
        got = pol.pick(eps, _req(_hint(prompt, session=s)))
        assert got is not None and got.name == first[s], s
    # The session policy still credits a home with the whole conversation.
    assert POLICIES["session"](GatewaySettings(), None).a.session_blocks is None  # type: ignore[attr-defined]


def test_slo_spill_sends_standard_work_to_a_clearly_faster_tier_and_keeps_critical() -> None:
    """The fp16 tier is busy, the fp8 tier idle: standard and sheddable work spills, critical
    stays; with a target the first tier meets, standard stays too."""
    for policy in (LatencyAware(), CacheAware()):
        pool = Pool(default_cap=256, policy=policy)
        p1, p2, f = _ep("p1", "primary", 100), _ep("p2", "primary", 100), _ep("f", "fallback", 10)
        for e in (p1, p2, f):
            pool.add(e)
        pool.routes = {k: ["primary", "fallback"] for k in ("critical", "standard", "sheddable")}
        assert pool.pick("m", "critical") in (p1, p2)
        assert pool.pick("m", "standard") is f
        assert pool.pick("m", "sheddable") is f
        f.slot.add(140)  # busier than the primaries: no longer clearly better
        assert pool.pick("m", "standard") in (p1, p2)
    for target, stays in ((10.0, True), (0.1, False)):
        pol = LatencyAware(LatencySettings(ttft_targets={"standard": target}))
        pool = Pool(default_cap=256, policy=pol)
        p, f = _ep("p1", "primary", 100), _ep("f", "fallback", 0)
        for e in (p, f):
            pool.add(e)
        now = time.monotonic()
        for i in range(40):  # 0.25 s decode steps on the primary: ~0.5 s expected first token
            p.latency.gap(0.25, now=now - 0.4 + i * 0.01)
        pool.routes = {"standard": ["primary", "fallback"]}
        assert (pool.pick("m", "standard") is p) == stays, target


def test_registry_and_settings() -> None:
    assert set(POLICIES) == {
        "prefix", "session", "latency", "least_load", "power_of_two", "round_robin", "random"
    }  # fmt: skip
    assert isinstance(make_policy(GatewaySettings()), CacheAware)  # the default
    assert isinstance(make_policy(GatewaySettings(routing="round_robin")), RoundRobin)
    with pytest.raises(ValueError, match=r"routing policy 'nope'.* cache_aware = prefix"):
        GatewaySettings(routing="nope")  # type: ignore[arg-type]
    # The peers' names, as a user's existing configuration writes them.
    for peer, ours in (("cache_aware", "prefix"), ("consistent_hash", "session"),
                       ("roundrobin", "round_robin"), ("prefixaware", "prefix")):  # fmt: skip
        assert GatewaySettings(routing=peer).routing == ours  # type: ignore[arg-type]
    rr = RoundRobin()
    a, b = _ep("a", inflight=50), _ep("b")
    assert [rr.pick([a, b], _req(None)) for _ in range(4)] == [a, b, a, b]


@pytest.mark.parametrize(
    ("loads", "share_of_least", "never"),
    [
        ((0, 5), 1.0, 5),  # two candidates: always the less loaded
        ((0, 5, 10), 2 / 3, 10),  # the least is in 2 of the 3 pairs; the most loaded never wins
        ((3, 3, 3, 9), None, 9),  # equal loads share; the outlier is never chosen over them
    ],
)
def test_power_of_two_takes_the_less_loaded_of_two_draws(
    loads: tuple[int, ...], share_of_least: float | None, never: int
) -> None:
    eps = [_ep(f"e{i}", inflight=n) for i, n in enumerate(loads)]
    p2c = PowerOfTwo(random.Random(7))
    picks = Counter(p2c.pick(eps, _req(None)).load for _ in range(3000))  # type: ignore[union-attr]
    assert picks[never] == 0, picks
    if share_of_least is not None:
        assert abs(picks[min(loads)] / 3000 - share_of_least) < 0.04, picks
    assert p2c.pick(eps[:1], _req(None)) is eps[0] and p2c.pick([], _req(None)) is None


def test_random_spreads_evenly_whatever_the_load() -> None:
    eps = [_ep("a", inflight=100), _ep("b"), _ep("c")]
    rnd = Random(random.Random(7))
    picks = Counter(rnd.pick(eps, _req(None)).name for _ in range(3000))  # type: ignore[union-attr]
    assert all(abs(picks[n] / 3000 - 1 / 3) < 0.04 for n in "abc"), picks
    assert rnd.pick([], _req(None)) is None


# -- real processes -----------------------------------------------------------------------------
@pytest.fixture
def two_engines(tmp_path: Path) -> list[Proc]:
    engs = [engine(tmp_path, name=f"e{i}") for i in range(2)]
    yield engs
    for e in engs:
        e.stop()


def test_conversations_and_shared_prompts_stay_put_across_two_workers(
    tmp_path: Path, two_engines: list[Proc]
) -> None:
    """Two gateway workers, two engines, fresh connections (the kernel spreads them over the
    workers): every turn of a conversation (session header) lands on one engine, and every
    request with the same long system prompt lands on one engine, though no worker saw all
    of them: the homes are the same in every worker. The policy is named as vllm-router
    names it (`cache_aware`): a user's existing flag keeps working."""
    urls = [e.url for e in two_engines]
    spread = ("--accept-pack-cpu", "0")  # both workers serve (no packing under light load)
    g = gateway(tmp_path, *urls, args=("--workers", "2", "--routing", "cache_aware", *spread))
    try:
        assert admin(g, "GET", "/admin/status").json()["routing"] == "prefix"
        where: dict[str, set[str]] = {}
        for turn in range(4):
            for conv in range(6):
                body = {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": f"conversation {conv} turn {turn}"}],
                    "max_tokens": 3,
                }
                # Half name their conversation as vllm-router's users do (X-User-ID).
                key = "x-session-id" if conv % 2 else "X-User-ID"
                with httpx.Client(timeout=30) as c:
                    r = c.post(
                        g.url + "/v1/chat/completions",
                        json=body,
                        headers={key: f"conv-{conv}"},
                    )
                assert r.status_code == 200, r.text
                where.setdefault(f"conv-{conv}", set()).add(r.headers["x-unbroken-endpoint"])
        for group in range(6):
            system = _words(400, 50 + group)
            for q in range(4):
                body = {"model": MODEL, "prompt": f"{system} question {q}", "max_tokens": 3}
                with httpx.Client(timeout=30) as c:
                    r = c.post(g.url + "/v1/completions", json=body)
                assert r.status_code == 200, r.text
                where.setdefault(f"group-{group}", set()).add(r.headers["x-unbroken-endpoint"])
        assert all(len(v) == 1 for v in where.values()), where
        assert len({next(iter(v)) for v in where.values()}) == 2  # both engines are used
    finally:
        g.stop()


@pytest.mark.parametrize("workers", [1, 2])
def test_an_engine_restarted_in_place_is_not_credited_with_its_old_prefixes(
    tmp_path: Path, two_engines: list[Proc], workers: int
) -> None:
    """An engine process replaced at the same address (a container restarted in its pod, the
    pod's IP kept) starts with an empty KV cache: once the prober sees its token counter go
    back, the index no longer credits it with the prompts sent there before (one process: the
    policy's own table; two workers: the shared table's column, cleared by the main process).
    The gateway's own hit estimate (unbroken_gateway_prefix_hit_blocks_total) shows it."""
    g = gateway(tmp_path, *(e.url for e in two_engines), args=("--workers", str(workers)))
    body = {"model": MODEL, "prompt": _words(600, 71), "max_tokens": 3}

    def send() -> tuple[str, float]:
        before = metric(g.url, "unbroken_gateway_prefix_hit_blocks_total")
        r = httpx.post(g.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        # A worker's counts reach the main process's /metrics with its next report.
        return r.headers["x-unbroken-endpoint"], before

    def hits_since(before: float) -> float:
        return metric(g.url, "unbroken_gateway_prefix_hit_blocks_total") - before

    try:
        where, before = send()
        where2, mid = send()
        assert where2 == where
        wait_for(lambda: hits_since(mid) > 0, timeout=10, what="the repeat credited as cached")
        port = int(where.rsplit(":", 1)[1])
        old = next(e for e in two_engines if e.port == port)

        def seen() -> float:
            eps = admin(g, "GET", "/admin/endpoints").json()["endpoints"]
            return next(e for e in eps if e["name"] == where)["generated_tokens"] or 0.0

        # The prober has read what the engine generated for these requests (a fall from it
        # is the sign of a restart; a scrape of the old engine's warm-up alone is 1 token).
        wait_for(lambda: seen() >= 6, timeout=10, what=lambda: f"the scrape: {seen()}")
        old.signal(signal.SIGKILL)
        old.popen.wait()  # type: ignore[union-attr]
        old.start()  # the same command: the same port, a new process
        wait_for(
            lambda: "restarted (vllm:generation_tokens_total went back" in g.log.read_text(),
            timeout=20,
            what=lambda: f"the gateway noticing the restart:\n{g.tail(15)}",
        )
        settled = metric(g.url, "unbroken_gateway_prefix_hit_blocks_total")
        _, before = send()
        time.sleep(1.0)  # a worker's counts reach the main process within its report period
        assert before >= settled
        assert hits_since(before) == 0, "the restarted engine was still credited with the prompt"
    finally:
        g.stop()


def test_responses_api_requests_route_by_prefix_and_session(
    tmp_path: Path, two_engines: list[Proc]
) -> None:
    """/v1/responses is relayed as is, but routed as chat is: a conversation (the session
    header, or the body's `user`) stays on one engine, and requests with the same long
    instructions land on one engine (they were spread like any pass-through request)."""
    urls = [e.url for e in two_engines]
    g = gateway(tmp_path, *urls, args=("--routing", "prefix"))
    try:
        where: dict[str, set[str]] = {}

        def ask(key: str, body: dict[str, object], **headers: str) -> None:
            r = httpx.post(g.url + "/v1/responses", json=body, headers=headers, timeout=30)
            assert r.status_code == 200, r.text
            where.setdefault(key, set()).add(r.headers["x-unbroken-endpoint"])

        for turn in range(4):
            for conv in range(6):
                ask(
                    f"conv-{conv}",
                    {"model": MODEL, "input": f"conversation {conv} turn {turn}",
                     "max_output_tokens": 3},
                    **{"x-session-id": f"conv-{conv}"},
                )  # fmt: skip
                ask(
                    f"user-{conv}",
                    {"model": MODEL, "input": f"user {conv} turn {turn}", "user": f"u{conv}",
                     "max_output_tokens": 3},
                )  # fmt: skip
        for group in range(6):
            system = _words(400, 90 + group)
            for q in range(4):
                items = [{"role": "user", "content": [{"type": "input_text", "text": f"q {q}"}]}]
                ask(
                    f"group-{group}",
                    {"model": MODEL, "instructions": system, "input": items,
                     "max_output_tokens": 3},
                )  # fmt: skip
        assert all(len(v) == 1 for v in where.values()), where
        assert len({next(iter(v)) for v in where.values()}) == 2  # both engines are used
    finally:
        g.stop()


def test_the_index_counts_its_own_estimate_of_hits_and_exports_it() -> None:
    """Per admitted leg, the blocks looked up and the leading blocks the index credited to
    the replica chosen: a repeated prompt is all hits, a new one none; the gateway's
    /metrics exposes both (unbroken_gateway_prefix_*_blocks_total)."""
    from prometheus_client import generate_latest

    from unbroken.gateway._admission import Admission
    from unbroken.gateway._metrics import GatewayMetrics
    from unbroken.gateway._pool import Pool

    pool = Pool(default_cap=256, policy=CacheAware())
    for n in "ab":
        pool.add(_ep(n))
    shared = _words(600, 3)
    for prompt in (shared, shared + " and a question", _words(300, 4)):
        h = _hint(prompt)
        ep = pool.pick("m", "standard", (), h)
        assert ep is not None
        pool.admitted(ep, "m", "standard", h)
    pol = pool.policy
    first, second, third = (
        len(_hint(p).blocks) for p in (shared, shared + " and a question", _words(300, 4))
    )
    assert pol.lookup_blocks == first + second + third
    assert pol.hit_blocks == first  # the second prompt's shared head, nothing else
    text = generate_latest(GatewayMetrics(pool, Admission(pool, queue_timeout=1)).registry).decode()
    assert f"unbroken_gateway_prefix_hit_blocks_total {float(first)}" in text
    assert f"unbroken_gateway_prefix_lookup_blocks_total {float(first + second + third)}" in text


@pytest.mark.parametrize(
    "names",
    [
        [f"127.0.0.1:{p}" for p in (18101, 18102, 18103)],
        [f"10.0.0.{i}:8000" for i in range(1, 5)],
        [f"10.244.{i}.{j}:8000" for i, j in ((1, 7), (1, 9), (2, 3), (2, 4), (3, 11))],
        [f"primary-{i}" for i in range(8)],
    ],
)
def test_rendezvous_homes_are_even(names: list[str]) -> None:
    """Each replica is home to its share of sessions and of new prefixes' first blocks
    (same-length names made CRC-only weights give one replica half of the keys)."""
    eps = [_ep(n) for n in names]
    n = 12_000
    for keys in (
        [f"user-{i}".encode() for i in range(n)],
        [i.to_bytes(4, "little") for i in random.Random(3).sample(range(2**32), n)],
    ):
        counts = {e.name: 0 for e in eps}
        for k in keys:
            h = home(k, eps)
            assert h is not None
            counts[h.name] += 1
        share = n / len(eps)
        assert all(abs(c - share) < 0.1 * share for c in counts.values()), counts


def test_a_cache_salt_is_a_prefix_of_its_own() -> None:
    """vLLM never serves a salted prompt from another salt's (or no salt's) blocks: the
    gateway's block names must not credit an endpoint with them either."""
    text = " ".join(VOCAB[i % len(VOCAB)] for i in range(300))

    def names(**more: str) -> list[int]:
        h = hint_of({"prompt": text, **more}, False, "m", block_chars=64, session=None)
        return [h.blocks[i] for i in range(len(h.blocks))]

    plain, a, b = names(), names(cache_salt="a"), names(cache_salt="b")
    assert len(plain) == len(a) > 10
    assert not set(plain) & set(a) and not set(a) & set(b)
    assert names(cache_salt="a") == a
    idx = PrefixIndex()
    idx.record("e1", plain)
    assert idx.cached("e1", plain) == len(plain) and idx.cached("e1", a) == 0
