"""The relay's per-event CPU in process: what the gateway's upstream read callback costs for
one SSE event, without sockets (the part of a relayed chunk that is the gateway's own
Python).

A `StreamRelay` is fed vLLM-shaped completion chunks (usage on every chunk and token ids, as
the gateway asks the engine for them; the client asked for neither, so both are stripped)
through `_on_body`, one event per read as an engine sends them, into a client sink that
takes everything. Rows: the fast path (`Transform._fast`, the default), the general path
alone (`Transform._event`, every event), and a floor: `orjson.loads` plus `orjson.dumps` of
the same event, the JSON round trip the relay used to do. Ratios are to the general path
measured in the same run. Times are the thread's CPU time (on a shared machine, wall time
counts the other processes' turns).

Run it with `PYTHONPATH=<another tree>/src` for the same table of another version.

    python benchmarks/relay_events.py [--events 128] [--streams 300]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import types
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).parent))

from _common import table
from unbroken.gateway._admission import Admission
from unbroken.gateway._metrics import GatewayMetrics
from unbroken.gateway._pool import Endpoint, Pool
from unbroken.gateway._stream import StreamRelay
from unbroken.gateway._transform import Transform


def chunk(i: int) -> bytes:
    ch = {
        "index": 0,
        "text": f" w{i}",
        "logprobs": None,
        "finish_reason": None,
        "stop_reason": None,
        "token_ids": [1000 + i],
    }
    obj = {
        "id": "cmpl-ef8775f1eaab4a55a04cc83210f69115",
        "object": "text_completion",
        "created": 1796297235,
        "model": "unbroken-sim",
        "choices": [ch],
        "usage": {"prompt_tokens": 20, "completion_tokens": i + 1, "total_tokens": 21 + i},
    }
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class _Sink:
    def send_nowait(self, data: bytes) -> bool:
        return True


class _Host:
    cfg = types.SimpleNamespace(max_sse_event_bytes=1 << 24, stall_timeout_s=30.0)

    def __init__(self) -> None:
        pool = Pool(100)
        self.metrics = GatewayMetrics(pool, Admission(pool, queue_timeout=1.0))

    def observe_ttfb(self, ep: Endpoint, seconds: float) -> None:
        pass


class _General(Transform):
    """Every event through the general path."""

    __slots__ = ()

    def _fast(self, *event: Any) -> None:  # (raw, data); an SSEEvent in older trees
        return None


def relay_us(events: list[bytes], streams: int, general: bool) -> float:
    host, ep = _Host(), Endpoint(name="e", url="http://e")
    total = 0.0
    for _ in range(streams):
        r = StreamRelay(
            host,  # type: ignore[arg-type]
            None,  # type: ignore[arg-type]
            path="/v1/completions",
            body=b"{}",
            chat=False,
            model="m",
            priority="standard",
            headers={},
            t0=time.monotonic(),
            augmented=True,
        )
        if general:
            r.x = _General(False, augmented=True, wants=(False, False, False))
        r.x.new_leg(rewrite=False)
        r.ep = ep
        r.sink = _Sink()  # type: ignore[assignment]
        t = time.thread_time()
        for e in events:
            r._on_body(e)
        total += time.thread_time() - t
        assert r.sent == len(events) and r.x.exact, (r.sent, r.x.exact)
    return total / streams / len(events) * 1e6


def floor_us(events: list[bytes], streams: int) -> float:
    t = time.thread_time()
    for _ in range(streams):
        for e in events:
            o: Any = orjson.loads(e[6:-2])
            del o["usage"]
            b"data: " + orjson.dumps(o) + b"\n\n"
    return (time.thread_time() - t) / streams / len(events) * 1e6


async def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--events", type=int, default=128, help="events per stream")
    ap.add_argument("--streams", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    events = [chunk(i) for i in range(args.events)]
    rows: dict[str, list[float]] = {"fast": [], "general": [], "floor": []}
    for _ in range(args.repeats):  # interleaved: drift hits every row alike
        rows["general"].append(relay_us(events, args.streams, general=True))
        rows["fast"].append(relay_us(events, args.streams, general=False))
        rows["floor"].append(floor_us(events, args.streams))
    base = min(rows["general"])
    names = {
        "general": "general path (`Transform._event`, every event)",
        "fast": "fast path (`Transform._fast`, the default)",
        "floor": "floor: orjson loads + dumps only",
    }
    out = [[names[k], f"{min(v):.2f}", f"{min(v) / base:.2f}x"] for k, v in rows.items()]
    print(table(["path", "us per event (best of repeats)", "vs general path"], out))


if __name__ == "__main__":
    asyncio.run(main())
