"""CPU cost of cache-aware routing per request: the prompt's text for naming its blocks
(`hint_of`: the names themselves are computed when asked for), scoring the candidates
(`CacheAware.pick`: the names its binary searches probe) and recording the pick (`on_admit`:
every name, then the index's record), against what the gateway pays per request anyway in
the same run: parsing the request body (orjson) and the latency-aware pick without a prompt.
Each call gets a fresh hint, as each request does (a hint keeps the names it computed).
`before send` is what delays the engine's start (`hint_of` + pick): the gateway records the
pick once the request is on the engine's socket.

    .venv/bin/python benchmarks/routing_cost.py [--candidates 3] [--repeat 2000]

Prints a table (µs per request, median of 5 batches) with the ratio to parsing the body.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import orjson

from unbroken.engine.textmodel import VOCAB
from unbroken.gateway._affinity import CacheAware
from unbroken.gateway._latency import LatencyAware
from unbroken.gateway._pool import Endpoint, PickRequest, State
from unbroken.gateway._prefix import hint_of


def _time(fn: Callable[[], object], repeat: int) -> float:
    """Median µs per call over 5 batches of `repeat` calls."""
    runs = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(repeat):
            fn()
        runs.append((time.perf_counter() - t) / repeat * 1e6)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--candidates", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=2000)
    args = ap.parse_args()
    r = random.Random(0)
    eps = []
    for i in range(args.candidates):
        e = Endpoint(name=f"engine-{i}", url=f"http://e{i}")
        e.models = {"m"}
        e.set_state(State.READY)
        eps.append(e)
    print(
        f"{'prompt':<28} {'parse body':>11} {'hint_of':>9} {'pick':>8} {'before send':>12} "
        f"{'on_admit':>9} {'total':>8} {'x parse':>8} {'latency pick':>13}"
    )
    for tokens in (1000, 4000, 16000):
        for chat in (False, True):
            words = " ".join(r.choice(VOCAB) for _ in range(tokens))
            raw = (
                {
                    "model": "m",
                    "messages": [
                        {"role": "system", "content": words},
                        {"role": "user", "content": "why?"},
                    ],
                }
                if chat
                else {"model": "m", "prompt": words}
            )
            body = orjson.dumps(raw)
            pol, plain = CacheAware(), LatencyAware()
            hint = hint_of(raw, chat, "m", block_chars=64, session=None)
            req = PickRequest("m", "standard", hint)
            pol.on_admit(eps[0], req)  # a warm index: one candidate holds the prompt
            t_parse = _time(lambda b=body: orjson.loads(b), args.repeat)
            t_hint = _time(
                lambda raw=raw, chat=chat: hint_of(raw, chat, "m", block_chars=64, session=None),
                args.repeat,
            )

            def fresh(raw: dict[str, object] = raw, chat: bool = chat) -> PickRequest:
                h = hint_of(raw, chat, "m", block_chars=64, session=None)
                return PickRequest("m", "standard", h)

            t_pick = _time(lambda pol=pol, f=fresh: pol.pick(eps, f()), args.repeat) - t_hint
            t_admit = (
                _time(lambda pol=pol, f=fresh: pol.on_admit(eps[0], f()), args.repeat) - t_hint
            )
            t_plain = _time(lambda p=plain: p.pick(eps, PickRequest("m", "standard")), args.repeat)
            before = t_hint + t_pick
            total = before + t_admit
            name = f"{tokens} tokens {'chat' if chat else 'completion'}"
            print(
                f"{name:<28} {t_parse:>9.1f}µs {t_hint:>7.1f}µs {t_pick:>6.1f}µs "
                f"{before:>10.1f}µs {t_admit:>7.1f}µs {total:>6.1f}µs {total / t_parse:>7.2f}x "
                f"{t_plain:>11.1f}µs"
            )


if __name__ == "__main__":
    main()
