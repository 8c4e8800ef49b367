"""The messages between the gateway's processes (`gateway/_messages.py`) survive their codec:
the main process's state, written from its endpoints, reads back into a worker's endpoints
field for field; and a stream's handover state restores a stream that snapshots the same.
In process, no sockets: what a worker's control socket carries is exactly `encode`'s line."""

from __future__ import annotations

import logging
import time
import types
from pathlib import Path
from typing import Any

import orjson
import pytest

from unbroken.config.spec import GatewaySettings
from unbroken.gateway._adapters import LoraInfo
from unbroken.gateway._admission import Admission
from unbroken.gateway._messages import (
    DrainMsg,
    EndpointState,
    StateMsg,
    apply_endpoint,
    decode,
    encode,
    endpoint_state,
    state_message,
)
from unbroken.gateway._metrics import GatewayMetrics
from unbroken.gateway._pool import Endpoint, Pool, State
from unbroken.gateway._shared import SharedCounters, SharedSlot
from unbroken.gateway._stream import StreamRelay
from unbroken.gateway._worker import WorkerGateway


def _main_pool(shared: SharedCounters) -> Pool:
    """A main process's pool with every field of an endpoint set to something not default."""
    pool = Pool(7)
    pool.routes = {"critical": ["a", "b"], "standard": ["b"]}
    pool.routes_override = {"sheddable": ["b"]}
    pool.pool_order = ["a", "b"]
    busy = Endpoint(name="e0", url="http://h0:8000", pool="a", cap=12, slot=SharedSlot(shared, 0))
    busy.cap_override = 5
    busy.set_condition("contended")
    busy.set_state(State.READY)
    busy.healthy = False
    busy.models = {"m", "m-lora"}
    busy.note_error("ttfb: no answer within 5.0 s")
    busy.waiting, busy.running, busy.kv_usage = 3.0, 9.0, 0.42
    busy.adapters = {"m-lora": "m"}
    busy.lora = LoraInfo(4, frozenset({"m-lora"}), frozenset(), frozenset({"x"}), 12.5)
    busy.warmup_s = 0.25
    draining = Endpoint(name="e1", url="http://h1:8000", pool="b", slot=SharedSlot(shared, 3))
    draining.models = {"m"}
    draining.set_state(State.DRAINING)
    draining.drain_deadline = time.monotonic() + 30.0
    for ep in (busy, draining):
        pool.add(ep)
    return pool


def test_a_state_message_round_trips_into_a_workers_endpoints(tmp_path: Path) -> None:
    shared = SharedCounters(tmp_path / "admission", create=True)
    try:
        pool = _main_pool(shared)
        now = time.monotonic()
        msg = state_message(pool, 4, None, [3, 1], now)
        line = encode(msg)
        assert line.endswith(b"\n") and line.count(b"\n") == 1
        back: StateMsg = decode(line)
        assert back["t"] == "state" and back["seq"] == 4 and back["replicas"] == [3, 1]
        assert back["routes"] == pool.routes and back["pool_order"] == pool.pool_order
        for sent, got in zip(msg["endpoints"], back["endpoints"], strict=True):
            assert got == sent
            ep = Endpoint(name=got["name"], url="", slot=SharedSlot(shared, got["col"]))
            apply_endpoint(ep, got)
            again: EndpointState = endpoint_state(ep, now)
            if got["deadline"] is None:
                assert again == got
            else:  # the worker sets its own drain timer from what is left; the rest is equal
                assert again["deadline"] is None and ep.state == State.DRAINING
                assert {**again, "deadline": got["deadline"]} == got
        assert back["endpoints"][1]["deadline"] is not None
        assert 29.0 < back["endpoints"][1]["deadline"] <= 30.0
    finally:
        shared.close()


async def test_a_worker_applies_the_main_processes_state(tmp_path: Path) -> None:
    """What `_worker.WorkerGateway.apply` makes of a state line: the main pool's endpoints,
    caps, routes, the drain deadline armed; an endpoint left out of the next state is gone."""
    shared = SharedCounters(tmp_path / "admission", create=True)
    try:
        main = _main_pool(shared)
        w = WorkerGateway(GatewaySettings(), shared, types.SimpleNamespace(is_closing=lambda: True))
        w.apply(decode(encode(state_message(main, 1, "shutting down", [1, 0], time.monotonic()))))
        assert w.pool.default_cap == 7 and w.pool.routes == main.routes
        assert w.pool.routes_override == main.routes_override and w.closing == "shutting down"
        now = time.monotonic()
        for name, ep in main.endpoints.items():
            mine = w.pool.get(name)
            assert mine is not None and mine.slot.col == ep.slot.col  # type: ignore[attr-defined]
            want = endpoint_state(ep, now)
            got = endpoint_state(mine, now)
            assert abs((got["deadline"] or 0.0) - (want["deadline"] or 0.0)) < 1.0
            assert {**got, "deadline": None} == {**want, "deadline": None}
        assert "e1" in w._drain_timers
        main.remove("e1")
        w.apply(decode(encode(state_message(main, 2, None, [1, 0], time.monotonic()))))
        assert w.pool.get("e1") is None and "e1" not in w._drain_timers
        assert decode(encode(DrainMsg(t="drain", timeout=1.5, why="reload", handover=["s"]))) == {
            "t": "drain",
            "timeout": 1.5,
            "why": "reload",
            "handover": ["s"],
        }
    finally:
        shared.close()


def _chunk(i: int, finish: str | None = None) -> bytes:
    ch = {"index": 0, "text": f" w{i}", "finish_reason": finish, "token_ids": [100 + i]}
    obj: dict[str, Any] = {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1796297235,
        "model": "m",
        "choices": [ch],
        "usage": {"prompt_tokens": 3, "completion_tokens": i + 1, "total_tokens": 4 + i},
    }
    if i == 0:
        obj["prompt_token_ids"] = [1, 2, 3]
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class _Sink:
    def send_nowait(self, data: bytes) -> bool:
        return True


class _Host:
    cfg = types.SimpleNamespace(max_sse_event_bytes=1 << 24, stall_timeout_s=30.0)

    def __init__(self) -> None:
        pool = Pool(10)
        self.metrics = GatewayMetrics(pool, Admission(pool, queue_timeout=1.0))

    def observe_ttfb(self, ep: Endpoint, seconds: float) -> None:
        pass


async def test_a_streams_handover_state_round_trips() -> None:
    host = _Host()
    body = orjson.dumps({"model": "m", "prompt": "hi", "stream": True, "max_tokens": 9})
    r = StreamRelay(
        host,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        path="/v1/completions",
        body=body,
        chat=False,
        model="m",
        priority="critical",
        headers={"X-Request-ID": "abc"},
        t0=time.monotonic(),
        weight=2,
        augmented=True,
        wants=(True, False, False),
    )
    r.x.new_leg(rewrite=False)
    r.ep = Endpoint(name="e", url="http://e", pool="a")
    r.failed = [Endpoint(name="gone", url="http://g")]
    r.migrations = 1
    r.sink = _Sink()  # type: ignore[assignment]
    for i in range(4):
        r._take_chunk(_chunk(i))  # as the read callback takes it (`_on_body` may hold it)
    state = r.snapshot()
    assert state["sent"] == 4 and state["gen_ids"] == [100, 101, 102, 103]
    assert state["tracker"]["texts"] == {"0": " w0 w1 w2 w3"} and state["failed"] == ["gone"]
    back = StreamRelay.restore(host, decode(encode_state(state)), body)  # type: ignore[arg-type]
    again = back.snapshot()
    assert again == {**state, "failed": [], "pool": None}  # both are the new process's to set
    assert back.raw["max_tokens"] == 9 and back.priority == "critical" and back.weight == 2


def encode_state(state: Any) -> bytes:
    """The state as `_handover` sends it (JSON, beside the body)."""
    return orjson.dumps(state)


def test_one_engine_failure_on_many_streams_is_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An engine's crash breaks every stream on it at once: a review counted 16 identical
    warnings for 16 streams (~512 at 256 a replica). One per endpoint and kind every
    FAILURE_LOG_S; the rest at debug level, counted in the next warning."""
    from unbroken.gateway._health import FAILURE_LOG_S, EndpointHealth

    pool = Pool(8)
    ep = Endpoint(name="e0", url="http://h0:8000")
    pool.add(ep)
    health = EndpointHealth(
        GatewaySettings(), pool, GatewayMetrics(pool, Admission(pool, queue_timeout=1.0))
    )
    caplog.set_level(logging.DEBUG, logger="unbroken.gateway")
    for _ in range(16):
        health.upstream_failed(ep, "reset", "UpstreamClosed: the engine closed the connection")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "failed" in r.msg]
    debug = [r for r in caplog.records if r.levelno == logging.DEBUG and "failed" in r.msg]
    assert len(warnings) == 1 and len(debug) == 15
    assert ep.last_error == "reset: UpstreamClosed: the engine closed the connection"
    # Another kind is its own line; the same kind after the window says how many it held.
    health.upstream_failed(ep, "connect", "ConnectionRefusedError")
    key = ("e0", "reset")
    at, quiet = health._said[key]
    health._said[key] = (at - FAILURE_LOG_S, quiet)
    health.upstream_failed(ep, "reset", "again")
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("(connect)" in m for m in lines)
    assert "(15 more of these since the last warning" in lines[-1]


def test_every_break_reason_and_shed_code_is_exported_at_zero_and_documented() -> None:
    """A review found the docs' label lists behind what is exported, and `abort` and `ttfb`
    migrations absent until the first one (an alert on `increase()` then has no data)."""
    import re

    from prometheus_client import CollectorRegistry, generate_latest

    from unbroken.controller.scaling import ScalingLoop
    from unbroken.gateway._metrics import BREAK_REASONS, SHED_CODES

    pool = Pool(8)
    metrics = GatewayMetrics(pool, Admission(pool, queue_timeout=1.0))
    metrics.for_pool("p")
    text = generate_latest(metrics.registry).decode()
    for reason in BREAK_REASONS:
        assert f'unbroken_gateway_streams_migrated_total{{reason="{reason}"}} 0.0' in text
        assert f'unbroken_gateway_streams_dropped_total{{pool="p",reason="{reason}"}} 0.0' in text
    for code in SHED_CODES:
        assert f'reason="{code}"' in text
    doc = (Path(__file__).parents[1] / "docs" / "gateway.md").read_text()
    for name, want in (
        ("streams_migrated_total", BREAK_REASONS),
        ("streams_dropped_total", BREAK_REASONS),
        ("shed_total", SHED_CODES),
    ):
        row = next(ln for ln in doc.splitlines() if ln.startswith(f"| `unbroken_gateway_{name}`"))
        listed = set(re.findall(r"`(\w+)`", row.split("|")[3]))
        assert set(want) <= listed, (name, set(want) - listed)
    # The autoscaler's decisions, per ranged pool, at 0 before the first.
    reg = CollectorRegistry()
    loop = ScalingLoop("/nonexistent", list, "t", reg, print, dict, lambda _p: 0)
    ranged = {"autoscale": {"min": 0, "max": 2}, "model": "m", "cap": 4}
    scaling = {"target": 2.0, "tolerance": 0.1, "up_cooldown_s": 1.0, "down_quiet_s": 5.0,
               "down_cooldown_s": 1.0, "interval_s": 0.5}  # fmt: skip
    loop._configure([{"name": "gpu", **ranged, "scaling": scaling}])
    text = generate_latest(reg).decode()
    for direction in ("up", "down"):
        for outcome in ("done", "failed"):
            labels = f'direction="{direction}",outcome="{outcome}",pool="gpu"'
            assert f"unbroken_autoscale_decisions_total{{{labels}}} 0.0" in text, text


async def test_the_controller_exports_each_pools_declared_and_live_replicas() -> None:
    """`unbroken_pipeline_replicas{pool,state}` from the supervisor's /pools, every pool
    (ranged or not), so that a pool short of its size can be alerted on (an SRE's review:
    a replacement crash loop had no series to alert on). The supervisor's control socket is
    the boundary stood in for here: its answer is the shape `pools_summary` writes."""
    import aiohttp
    from prometheus_client import CollectorRegistry, generate_latest

    from unbroken.controller.scaling import ScalingLoop

    reg = CollectorRegistry()
    loop = ScalingLoop("/nonexistent", list, "t", reg, print, dict, lambda _p: 0)
    pools = [
        {"name": "primary", "model": "m", "declared": 2, "live": 1, "autoscale": None,
         "scaling": {}, "cap": 8},
        {"name": "fallback", "model": "m", "declared": 1, "live": 1, "autoscale": None,
         "scaling": {}, "cap": 8},
    ]  # fmt: skip

    async def answer() -> dict[str, Any]:
        return {"busy": False, "scaling": None, "pools": pools}

    loop.client.pools = answer  # type: ignore[method-assign]
    async with aiohttp.ClientSession() as session:
        await loop.once(session)
    text = generate_latest(reg).decode()
    assert 'unbroken_pipeline_replicas{pool="primary",state="declared"} 2.0' in text
    assert 'unbroken_pipeline_replicas{pool="primary",state="live"} 1.0' in text
    assert 'unbroken_pipeline_replicas{pool="fallback",state="live"} 1.0' in text
