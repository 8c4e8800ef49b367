"""vLLM's KV cache events, published as vLLM 0.32 publishes them (`--kv-events-config`).

A KV-aware router outside the engine (llm-d's precise prefix scorer, NVIDIA Dynamo's KV
router, a router of one's own) learns which prefix blocks an engine holds from these events
instead of guessing from what it routed. The simulator publishes the same wire format as
vLLM (vllm/distributed/kv_events.py, v1/core/block_pool.py), so such a router can be built
and tested against it on a CPU machine:

- ZeroMQ PUB on `endpoint` (bound if it has a `*`, `::`, or is `ipc://` / `inproc://`,
  else connected, as vLLM decides), three frames a message: the `topic`, an 8-byte
  big-endian sequence number from 0, and the payload;
- the payload is a msgpack `KVEventBatch` encoded by msgspec: an array `[ts, events,
  data_parallel_rank]` whose events are maps tagged by `"type"`: `BlockStored`
  (`block_hashes`, `parent_block_hash`, `token_ids`, `block_size`, `lora_id`, `medium`,
  `lora_name`, `extra_keys`, `group_idx`), `BlockRemoved` (`block_hashes`, `medium`,
  `group_idx`), `AllBlocksCleared`; one batch per engine step that has events, stamped with
  the wall clock;
- block hashes are unsigned 64-bit integers (vLLM's default,
  `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`), each block's chained over its parent's, the
  first block's parent `None`; `extra_keys` one entry per block: `None`, or the LoRA
  adapter's name and (first block only) the request's `cache_salt`;
- an optional ROUTER on `replay_endpoint`: a request of `[b"", start_seq as 8 bytes]` from a
  DEALER (or `[start_seq]` from a REQ) is answered with every batch kept (`buffer_steps`)
  from that sequence number on, `[b"", seq, payload]` each, then `[b"", -1 as 8 signed
  bytes, b""]`.

The hash values themselves are the simulator's (a chained hash of its token ids), not
vLLM's SHA-256 of the model's tokens: consumers must treat them as opaque ids, as they
must with vLLM, whose hashes depend on `PYTHONHASHSEED`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, fields
from itertools import count
from typing import Any

import msgspec
import orjson

__all__ = [
    "MEDIUM_GPU",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEventBatch",
    "KVEventsConfig",
    "ZmqEventPublisher",
    "external_hash",
    "parse_kv_events_config",
]

log = logging.getLogger("unbroken.engine.kvevents")

MEDIUM_GPU = "GPU"
_U64 = (1 << 64) - 1


def external_hash(h: int) -> int:
    """A block's hash as vLLM publishes it: an unsigned 64-bit integer."""
    return h & _U64


# The structs are vLLM 0.32's, field for field and in its order: msgspec encodes a tagged
# struct as a map with "type" first, omits optional fields left at their default (None), and
# always writes the required ones, None included.
class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """Base of the three event kinds."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig (vllm/config/kv_events.py), its names and defaults."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; None: zmq when enabled
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"


def parse_kv_events_config(text: str) -> KVEventsConfig:
    """`--kv-events-config` as vLLM takes it (a JSON object); ValueError with one line naming
    what is wrong, as vLLM refuses a bad config at start."""
    try:
        data = orjson.loads(text)
    except orjson.JSONDecodeError as e:
        raise ValueError(f"--kv-events-config: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError("--kv-events-config: expected a JSON object")
    known = {f.name: f for f in fields(KVEventsConfig)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(
            f"--kv-events-config: unknown field(s) {', '.join(unknown)} (known: {', '.join(known)})"
        )
    kinds: dict[str, tuple[type, ...]] = {
        "enable_kv_cache_events": (bool,),
        "publisher": (str, type(None)),
        "endpoint": (str,),
        "replay_endpoint": (str, type(None)),
        "buffer_steps": (int,),
        "hwm": (int,),
        "max_queue_size": (int,),
        "topic": (str,),
    }
    for k, v in data.items():
        ok = isinstance(v, kinds[k]) and not (isinstance(v, bool) and bool not in kinds[k])
        if not ok:
            raise ValueError(f"--kv-events-config: {k} has the wrong type ({v!r})")
    if data.get("publisher") is None:  # vLLM's __post_init__
        data["publisher"] = "zmq" if data.get("enable_kv_cache_events") else "null"
    cfg = KVEventsConfig(**data)
    if cfg.publisher not in ("zmq", "null"):
        raise ValueError(f"--kv-events-config: unknown event publisher {cfg.publisher!r}")
    for k in ("buffer_steps", "hwm", "max_queue_size"):
        if getattr(cfg, k) < 0 or (k == "max_queue_size" and cfg.max_queue_size == 0):
            raise ValueError(f"--kv-events-config: {k} must be positive")
    if cfg.publishes and not cfg.endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"--kv-events-config: endpoint {cfg.endpoint!r} is not a ZeroMQ address")
    return cfg


class ZmqEventPublisher:
    """vLLM's ZmqEventPublisher: the engine thread queues a step's batch; a thread of its own
    encodes, numbers, publishes and keeps it for replay, so the engine's step never waits on
    a socket (a slow subscriber drops at the high-water mark, as ZeroMQ PUB does)."""

    END_SEQ = (-1).to_bytes(8, "big", signed=True)

    def __init__(self, cfg: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        import zmq  # only an engine that publishes needs it

        self._zmq = zmq
        self.cfg = cfg
        self._rank = data_parallel_rank
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=cfg.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._seq = count()
        self._topic = cfg.topic.encode()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(cfg.hwm)
        self._replay: Any = None
        try:
            if _binds(cfg.endpoint):
                self._pub.bind(cfg.endpoint)
            else:
                self._pub.connect(cfg.endpoint)
            if cfg.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(cfg.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"--kv-events-config: cannot open {cfg.endpoint}: {e}") from None
        self.published = 0  # batches sent (read by /admin/state)
        self.dropped = 0  # batches the full queue refused
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[BlockStored | BlockRemoved | AllBlocksCleared]) -> None:
        """From the engine thread: one step's events, stamped now."""
        if not self._running or not events:
            return
        batch = KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self._rank)
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1  # vLLM's put blocks the scheduler; a simulator's step must not

    def shutdown(self, timeout: float = 1.0) -> None:
        """Send what is queued (up to `timeout`), then close."""
        if not self._running:
            return
        self._running = False
        self._queue.put(None)
        self._thread.join(timeout)
        self._close_sockets()
        self._ctx.term()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        enc = msgspec.msgpack.Encoder()
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except Exception:  # a bad replay request must not stop publishing
                    log.exception("KV events: replay request failed")
            try:
                batch = self._queue.get(timeout=0.1)
            except queue.Empty:
                if not self._running:
                    return
                continue
            if batch is None:
                return
            seq = next(self._seq)
            payload = enc.encode(batch)
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except self._zmq.ZMQError:
                log.exception("KV events: publishing batch %d failed", seq)
            self._buffer.append((seq, payload))
            self.published += 1

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("KV events: replay request of %d frames ignored", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", self.END_SEQ, b""))


def _binds(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard and ipc/inproc endpoints, connect to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
