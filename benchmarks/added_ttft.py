"""First-token time a router adds at idle: one client, one request at a time, the same
streaming chats sent straight to one simulated engine, through unbroken's gateway (its
default routing, `prefix`) and through vllm-router (the peer, `--policy round_robin`), in
turn, so that the machine's drift hits all three alike.

Two sizes: `short` (a 200-word system prompt and a 70-word question) and `multi-turn` (the
same after 5 turns of history, 70-word questions and 215-word replies: the size of
benchmarks/routing.py's multi-turn requests at their fifth turn). The first token is the
first event with text. What this isolates is a router's own path (parse, route, forward,
relay the first event), without the load that benchmarks/routing.py adds around it.

    python benchmarks/added_ttft.py [--requests 300] [--no-peer]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).parent))

from _common import (
    engine_service,
    gateway_service,
    install_peer,
    router_service,
    table,
    wait_http,
)

MODEL = "unbroken-sim"
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi".split()
SIZES = {"short": 0, "multi-turn": 5}  # turns of history
WARM = 20  # first requests of each path left out (connections, caches)


def messages(seed: int, turns: int) -> list[dict[str, str]]:
    r = random.Random(seed)

    def text(n: int) -> str:
        return " ".join(r.choice(WORDS) for _ in range(n))

    msgs = [{"role": "system", "content": text(200)}]
    for _ in range(turns):
        msgs += [{"role": "user", "content": text(70)}, {"role": "assistant", "content": text(215)}]
    return [*msgs, {"role": "user", "content": text(70)}]


async def first_token(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> float:
    t = time.perf_counter()
    async with s.post(url + "/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {(await r.read())[:200]!r}")
        ttft = None
        async for line in r.content:
            if ttft is None and line.startswith(b"data: {") and b'"content":"' in line:
                if b'"content":""' not in line:
                    ttft = time.perf_counter() - t
        if ttft is None:
            raise RuntimeError(f"{url}: no token")
        return ttft


async def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=300, help="per path and size")
    ap.add_argument("--no-peer", action="store_true", help="without vllm-router")
    args = ap.parse_args()
    peer, why = (None, "--no-peer") if args.no_peer else install_peer()
    logs = Path(tempfile.mkdtemp(prefix="added-ttft-"))
    eng = engine_service().start(logs, "engine")
    gw, _ = gateway_service(eng.url)
    gw.start(logs, "gateway")
    svcs = [eng, gw]
    paths = {"direct": eng.url, "unbroken": gw.url}
    if peer is not None:
        router = router_service(peer, [eng.url], "round_robin").start(logs, "vllm-router")
        svcs.append(router)
        paths["vllm-router"] = router.url
    try:
        for url in paths.values():
            await wait_http(url + "/health")
        res: dict[tuple[str, str], list[float]] = {}
        conn = aiohttp.TCPConnector(limit=4)
        async with aiohttp.ClientSession(connector=conn) as s:
            for size, turns in SIZES.items():
                order = list(paths)
                for i in range(args.requests + WARM):
                    body = {
                        "model": MODEL,
                        "messages": messages(i % 25, turns),
                        "max_tokens": 4,
                        "stream": True,
                    }
                    order = order[1:] + order[:1]  # each path first in turn
                    for name in order:
                        t = await first_token(s, paths[name], body)
                        if i >= WARM:
                            res.setdefault((size, name), []).append(t)
    finally:
        for svc in svcs:
            svc.stop()
    rows = []
    for size in SIZES:
        base = statistics.median(res[(size, "direct")])
        peer_added = (
            statistics.median(res[(size, "vllm-router")]) - base
            if (size, "vllm-router") in res
            else None
        )
        for name in paths:
            xs = res[(size, name)]
            p50 = statistics.median(xs)
            added = p50 - base
            rows.append(
                [
                    size,
                    name,
                    f"{p50 * 1e3:.2f}",
                    f"{statistics.mean(xs) * 1e3:.2f}",
                    "-" if name == "direct" else f"{added * 1e3:+.2f}",
                    "-"
                    if name == "direct" or not peer_added or peer_added <= 0
                    else f"{added / peer_added:.2f}x",
                ]
            )
    print(f"\n{args.requests} requests a path and size, one at a time (logs: {logs})")
    if peer is None:
        print(f"vllm-router not run: {why}")
    print(
        table(
            ["size", "path", "TTFT p50 ms", "mean ms", "added p50 ms", "added vs vllm-router"],
            rows,
        )
    )


if __name__ == "__main__":
    asyncio.run(main())
