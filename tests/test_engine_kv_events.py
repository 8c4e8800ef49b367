"""The simulator's KV cache events (`--kv-events-config`, engine/kvevents.py): the wire format
against bytes vLLM 0.32's own classes encode, the events the block pool records, and a real
`unbroken engine` process publishing over ZeroMQ with replay. The real-vLLM tier
(tests/vllm/test_vllm_kv_events.py) decodes these events with vLLM's own decoder and sets
them beside a real vLLM server's."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import msgpack
import msgspec
import pytest
import zmq

from helpers import MODEL, TOKEN, engine
from unbroken.engine.core import EngineCore, Seq
from unbroken.engine.kvcache import KVCache, root_hash
from unbroken.engine.kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    parse_kv_events_config,
)
from unbroken.engine.profiles import EngineProfile
from unbroken.engine.textmodel import VOCAB, StopChecker, TextModel, count_tokens, token_ids
from unbroken.wire.http import free_port

BS = 4

# vLLM 0.32: `msgspec.msgpack.Encoder().encode(KVEventBatch(ts=1.5, events=[BlockStored(
# block_hashes=[1, 2**63 + 5], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=2,
# lora_id=None, medium="GPU", lora_name=None, extra_keys=None, group_idx=0), BlockRemoved(
# block_hashes=[3], medium="GPU", group_idx=0), AllBlocksCleared()], data_parallel_rank=0))`,
# run in the vLLM tier's venv (vllm.distributed.kv_events).
VLLM_032_BATCH = bytes.fromhex(
    "93cb3ff80000000000009389a474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573"
    "9201cf8000000000000005b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f69647394010203"
    "04aa626c6f636b5f73697a6502a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0"
    "a967726f75705f6964780084a474797065ac426c6f636b52656d6f766564ac626c6f636b5f686173686573"
    "9103a66d656469756da3475055a967726f75705f6964780081a474797065b0416c6c426c6f636b73436c6561"
    "72656400"
)


def _words(n: int, offset: int = 0) -> str:
    return " ".join(VOCAB[(i * 7 + offset) % len(VOCAB)] for i in range(n))


def _seq(rid: str, text: str, **kw: Any) -> Seq:
    return Seq(
        rid,
        0,
        count_tokens(text),
        kw.pop("max_tokens", 2),
        TextModel().cursor(text),
        StopChecker([]),
        None,
        ignore_eos=True,
        token_ids=token_ids(text),
        **kw,
    )


def _core(blocks: int, events: list[Any]) -> EngineCore:
    prof = EngineProfile(
        "test",
        kv_capacity_tokens=blocks * BS,
        block_size=BS,
        decode_base_s=0.0,
        decode_per_seq_s=0.0,
        prefill_per_token_s=0.0,
    )
    return EngineCore(prof, lambda _o: None, cache_root=root_hash(MODEL), on_events=events.extend)


def _run(core: EngineCore, *seqs: Seq) -> None:
    core.waiting.extend(seqs)
    while core.running or core.waiting:
        core._step()


# -- the wire format --------------------------------------------------------------------------
def test_a_batch_is_byte_for_byte_what_vllm_032_encodes() -> None:
    batch = KVEventBatch(
        ts=1.5,
        events=[
            BlockStored(
                block_hashes=[1, 2**63 + 5],
                parent_block_hash=None,
                token_ids=[1, 2, 3, 4],
                block_size=2,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                extra_keys=None,
                group_idx=0,
            ),
            BlockRemoved(block_hashes=[3], medium="GPU", group_idx=0),
            AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )
    assert msgspec.msgpack.encode(batch) == VLLM_032_BATCH
    # ... and a plain msgpack reader sees vLLM's shape: [ts, [{type, ...}], rank].
    ts, events, rank = msgpack.unpackb(VLLM_032_BATCH)
    assert (ts, rank, [e["type"] for e in events]) == (
        1.5,
        0,
        ["BlockStored", "BlockRemoved", "AllBlocksCleared"],
    )
    assert msgspec.msgpack.decode(VLLM_032_BATCH, type=KVEventBatch) == batch


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("{", "not valid JSON"),
        ("[1]", "expected a JSON object"),
        ('{"enable_kv_cache_events": true, "endpont": "x"}', "unknown field(s) endpont"),
        ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events has the wrong type"),
        ('{"buffer_steps": true}', "buffer_steps has the wrong type"),
        ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "unknown event publisher"),
        ('{"enable_kv_cache_events": true, "endpoint": "localhost:5557"}', "not a ZeroMQ"),
        ('{"max_queue_size": 0}', "max_queue_size must be positive"),
    ],
)
def test_a_bad_config_is_refused_in_one_line(text: str, error: str) -> None:
    with pytest.raises(ValueError, match="--kv-events-config: ") as e:
        parse_kv_events_config(text)
    assert error in str(e.value) and "\n" not in str(e.value)


def test_config_defaults_are_vllms() -> None:
    on = parse_kv_events_config('{"enable_kv_cache_events": true}')
    assert (on.publisher, on.endpoint, on.topic, on.buffer_steps, on.hwm) == (
        "zmq",
        "tcp://*:5557",
        "",
        10_000,
        100_000,
    )
    assert on.publishes
    assert parse_kv_events_config("{}").publisher == "null"
    assert not parse_kv_events_config(
        '{"enable_kv_cache_events": true, "publisher": "null"}'
    ).publishes


# -- what the block pool records ---------------------------------------------------------------
def test_stored_events_chain_blocks_as_the_cache_names_them() -> None:
    events: list[Any] = []
    core = _core(64, events)
    shared = _words(8)  # two full blocks
    # 14 tokens: 3 full blocks at prefill, a 4th once 2 of its 4 output tokens are computed.
    a = _seq("a", shared + " " + _words(6, 1), max_tokens=4)
    _run(core, a)
    stored = [e for e in events if isinstance(e, BlockStored)]
    first = stored[0]
    assert first.parent_block_hash is None and first.block_size == BS
    assert first.token_ids == a.token_ids[:12] and len(first.block_hashes) == 3
    assert first.extra_keys == [None, None, None] and first.medium == "GPU"
    assert first.group_idx == 0 and first.lora_id is None and first.lora_name is None
    assert first.kv_cache_spec_kind == "full_attention"
    # Every hash is an unsigned 64-bit id, and the cache holds exactly what was announced.
    announced = [h for e in stored for h in e.block_hashes]
    assert all(0 <= h < 2**64 for h in announced)
    assert sorted(announced) == sorted(h & (2**64 - 1) for h in core.kv.cached)
    # A decode that fills a block announces it as the child of the block before it.
    later = stored[1:]
    assert later and later[0].parent_block_hash == first.block_hashes[-1]
    # A second prompt with the same first two blocks hits them: its first event's parent is
    # the second shared block, and the shared blocks are not announced again.
    events.clear()
    b = _seq("b", shared + " " + _words(8, 2))
    _run(core, b)
    assert b.cached_tokens == 8
    again = events[0]
    assert isinstance(again, BlockStored) and again.parent_block_hash == first.block_hashes[1]
    assert not set(again.block_hashes) & set(first.block_hashes)


def test_eviction_announces_removal_of_exactly_the_blocks_it_drops() -> None:
    events: list[Any] = []
    core = _core(8, events)  # 32 tokens of KV
    for i in range(6):
        _run(core, _seq(f"r{i}", _words(12, i * 3)))
    stored = {h for e in events if isinstance(e, BlockStored) for h in e.block_hashes}
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed, "six 3-block prompts in an 8-block cache must evict"
    assert all(len(e.block_hashes) == 1 for e in events if isinstance(e, BlockRemoved))
    assert set(removed) <= stored and len(set(removed)) == len(removed)
    held = {h & (2**64 - 1) for h in core.kv.cached}
    assert held == stored - set(removed)
    assert core.kv.evictions >= len(removed)


def test_lora_and_salt_go_into_extra_keys_as_vllm_publishes_them() -> None:
    events: list[Any] = []
    core = _core(64, events)
    s = _seq("a", _words(9), lora="sql", lora_id=3, cache_salt="tenant-1")
    _run(core, s)
    ev = events[0]
    assert (ev.lora_id, ev.lora_name) == (3, "sql")
    assert ev.extra_keys == [("sql", "tenant-1"), ("sql",)]  # the salt: first block only
    raw = msgpack.unpackb(msgspec.msgpack.encode(ev))
    assert raw["extra_keys"] == [["sql", "tenant-1"], ["sql"]]


def test_reset_clears_only_an_idle_cache_unless_told_to_preempt() -> None:
    events: list[Any] = []
    kv = KVCache(16, BS, events=True)
    s = _seq("a", _words(9))
    hit = kv.lookup(s, s.num_tokens)
    kv.admit(s, hit, kv.blocks_for(s.num_tokens + 1))
    kv.cache_full(s, s.num_tokens)
    assert not kv.reset()  # a sequence holds blocks
    kv.release(s)
    assert kv.reset() and not kv.cached
    assert isinstance(kv.take_events()[-1], AllBlocksCleared)
    assert kv.take_events() == []
    # Through the core, on its thread: a running sequence makes it fail unless preempted.
    core = _core(64, events)
    core.start()
    try:
        assert core.reset_prefix_cache().result(5) is True
        assert isinstance(events[-1], AllBlocksCleared)
    finally:
        core.stop()


def test_no_events_are_recorded_without_a_publisher() -> None:
    kv = KVCache(16, BS)
    s = _seq("a", _words(9))
    kv.admit(s, kv.lookup(s, s.num_tokens), kv.blocks_for(s.num_tokens + 1))
    kv.cache_full(s, s.num_tokens)
    assert kv.events is None and kv.take_events() == []


# -- a real engine process ---------------------------------------------------------------------
def _subscribe(ctx: zmq.Context[Any], port: int, topic: bytes) -> zmq.Socket[Any]:
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{port}")
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    return sub


def _drain(sock: zmq.Socket[Any], quiet_s: float = 0.5) -> list[tuple[bytes, int, KVEventBatch]]:
    out = []
    dec = msgspec.msgpack.Decoder(KVEventBatch)
    while sock.poll(int(quiet_s * 1000)):
        topic, seq, payload = sock.recv_multipart()
        out.append((topic, int.from_bytes(seq, "big"), dec.decode(payload)))
    return out


def test_an_engine_publishes_its_cache_over_zmq_with_replay(tmp_path: Path) -> None:
    pub, replay = free_port(), free_port()
    cfg = (
        '{"enable_kv_cache_events": true, "publisher": "zmq", '
        f'"endpoint": "tcp://*:{pub}", "replay_endpoint": "tcp://*:{replay}", "topic": "kv@sim"}}'
    )
    e = engine(
        tmp_path,
        "--block-size",
        str(BS),
        "--kv-capacity-tokens",
        "64",
        "--kv-events-config",
        cfg,
        env={"VLLM_SERVER_DEV_MODE": "1"},
    )
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        sub = _subscribe(ctx, pub, b"kv@sim")
        time.sleep(0.3)  # a SUB joins a few ms after connect: earlier messages are not its
        prompts = [_words(10), _words(10) + " " + _words(6, 5), _words(30, 9)]
        for p in prompts:
            r = httpx.post(
                e.url + "/v1/completions",
                json={"model": MODEL, "prompt": p, "max_tokens": 8, "ignore_eos": True},
                timeout=10,
            )
            assert r.status_code == 200, r.text
        got = _drain(sub)
        assert got, "no KV events arrived"
        assert [seq for _, seq, _ in got] == list(range(len(got)))  # numbered from 0, in order
        assert {t for t, _, _ in got} == {b"kv@sim"}
        events = [ev for _, _, b in got for ev in b.events]
        stored = [ev for ev in events if isinstance(ev, BlockStored)]
        assert stored[0].token_ids[: 2 * BS] == token_ids(prompts[0])[: 2 * BS]
        # The second prompt shares the first's two full blocks: no event repeats them.
        first_blocks = stored[0].block_hashes[:2]
        assert sum(h in first_blocks for ev in stored for h in ev.block_hashes) == 2
        assert any(isinstance(ev, BlockRemoved) for ev in events)  # 64 tokens of KV overflow
        assert all(b.data_parallel_rank == 0 and b.ts > 1.7e9 for _, _, b in got)
        # The cache reset (vLLM's dev route) announces AllBlocksCleared.
        r = httpx.post(e.url + "/reset_prefix_cache", timeout=10)
        assert r.json() == {"success": True}
        (_, last, batch), *_ = _drain(sub)
        assert last == len(got) and batch.events == [AllBlocksCleared()]
        # Replay from sequence 1: every kept batch from there, then the end marker.
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay}")
        dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        seqs = []
        while dealer.poll(5000):
            _, seq, payload = dealer.recv_multipart()
            n = int.from_bytes(seq, "big", signed=True)
            if n == -1:
                assert payload == b""
                break
            seqs.append(n)
            msgspec.msgpack.decode(payload, type=KVEventBatch)
        assert seqs == list(range(1, last + 1))
        state = httpx.get(e.url + "/admin/state", headers={"Authorization": f"Bearer {TOKEN}"})
        assert state.json()["kv_events"]["published"] == last + 1
    finally:
        e.stop()
        ctx.destroy(linger=0)


def test_the_reset_route_exists_only_in_vllms_dev_mode(tmp_path: Path) -> None:
    e = engine(tmp_path)
    try:
        assert httpx.post(e.url + "/reset_prefix_cache", timeout=5).status_code == 404
    finally:
        e.stop()


def test_an_engine_with_a_bad_kv_events_config_does_not_start(tmp_path: Path) -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "unbroken.engine",
            "--port",
            str(free_port()),
            "--kv-events-config",
            '{"enable_kv_cache_events": true, "topic": 5}',
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "--kv-events-config: topic has the wrong type" in r.stderr
