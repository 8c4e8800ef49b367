"""Fair queueing within a priority (issue 25): a greedy tenant and a light tenant of the same
priority through a real gateway on a real simulator engine.

The greedy tenant keeps `--greedy` streams in flight (each ends and is replaced at once), far
more than the pool's cap (`--cap`), so the gateway's queue always holds a few hundred of its
requests; the light tenant sends one short stream at a time. Three phases, each on a fresh
gateway in front of the same engine: the light tenant alone; the greedy tenant within the
pool (cap - 1 streams: it never queues, so the light request never waits for a slot and what
is left is the engine's batch and the shared CPUs: the best any admission rule can do
without preemption); both, with tenants configured (fair queueing and the reserve: the light
request finds the slot an over-share tenant may not take); both without tenants (one FIFO
queue, as before: the light request waits behind the greedy backlog). Rows: the light
tenant's TTFT (p50, p99), the ratios of its p99 to the alone and the greedy-within-the-pool
p99 measured in the same run, and from the gateway's own
`unbroken_gateway_tenant_queue_wait_seconds{tenant="light"}`: its mean wait for a slot and how
many of its requests waited over 1 ms; and the engine's own mean TTFT over the phase (all its
requests, greedy's too: arrival at the engine to first token, i.e. the batch's share); the
gateway's CPU per request answered over the phase (the cost of the backlog it holds).

`--before SRC` adds the fair-queueing phase once more with the gateway run from another
source tree (e.g. `git archive COMMIT src | tar -x -C DIR`, then `--before DIR/src`): the
same run's figure for the code before a change.

    python benchmarks/fairness.py [--light 60] [--greedy 300] [--cap 32] [--before SRC]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).parent))

from _common import engine_service, gateway_service, table, tree_cpu_seconds, wait_http
from unbroken.bench.stats import percentile
from unbroken.config.tenants import key_digest

MODEL = "unbroken-sim"
# A short step so that a phase is quick; its cost grows 64 % from 1 to 32 sequences, a
# CPU's slope more than a GPU's (the fp16 profile's 20 ms + 0.15 ms a sequence grows 24 %).
FAST_STEPS = (
    "--decode-base-s", "0.005", "--decode-per-seq-s", "0.0001", "--prefill-per-token-s", "0.00001",
)  # fmt: skip
LIGHT, GREEDY = "sk-light", "sk-greedy"


async def ttft(s: aiohttp.ClientSession, url: str, key: str, max_tokens: int) -> float | None:
    """One streaming completion; seconds to its first token event (None: refused)."""
    body = {"model": MODEL, "prompt": "fair share", "max_tokens": max_tokens, "stream": True}
    t0 = time.perf_counter()
    async with s.post(
        url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as r:
        if r.status != 200:
            await r.read()
            return None
        first = None
        async for line in r.content:
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter() - t0
        return first


async def _hogs(url: str, greedy: int, max_tokens: int) -> None:
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:

        async def hog() -> None:
            while True:
                await ttft(s, url, GREEDY, max_tokens)

        await asyncio.gather(*(hog() for _ in range(greedy)))


def _hog_main(url: str, greedy: int, max_tokens: int) -> None:
    asyncio.run(_hogs(url, greedy, max_tokens))


async def phase(url: str, light: int, greedy: int, max_tokens: int) -> list[float]:
    """The light tenant's TTFTs; the greedy tenant runs in its own process, so that its
    streams do not delay the light client's event loop."""
    hogs = None
    if greedy:
        hogs = multiprocessing.get_context("spawn").Process(
            target=_hog_main, args=(url, greedy, max_tokens), daemon=True
        )
        hogs.start()
        await asyncio.sleep(4.0)  # the queue fills up
    out = []
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(light):
                t = await ttft(s, url, LIGHT, 8)
                if t is not None:
                    out.append(t)
                await asyncio.sleep(0.05)
    finally:
        if hogs is not None:
            hogs.kill()
            hogs.join()
    return out


async def light_waits(s: aiohttp.ClientSession, url: str) -> tuple[float, int] | None:
    """The light tenant's mean wait for a slot (ms) and how many of its requests waited over
    1 ms, from the gateway's histogram (None without tenants: no such series)."""
    async with s.get(url + "/metrics") as r:
        text = await r.text()
    got: dict[str, float] = {}
    for line in text.splitlines():
        if (
            line.startswith("unbroken_gateway_tenant_queue_wait_seconds")
            and 'tenant="light"' in line
        ):
            name, _, value = line.rpartition(" ")
            if name.startswith("unbroken_gateway_tenant_queue_wait_seconds_bucket"):
                if 'le="0.001"' in name:
                    got["fast"] = float(value)
            else:
                got[name.split("{")[0].rsplit("_", 1)[1]] = float(value)
    if not got.get("count"):
        return None
    return got["sum"] / got["count"] * 1000, int(got["count"] - got.get("fast", 0.0))


async def engine_ttft(s: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    """The engine's own TTFT histogram: (sum, count), all requests (arrival to first token)."""
    async with s.get(url + "/metrics") as r:
        text = await r.text()
    got = {"sum": 0.0, "count": 0.0}
    for line in text.splitlines():
        for k in got:
            if line.startswith(f"vllm:time_to_first_token_seconds_{k}"):
                got[k] += float(line.rpartition(" ")[2])
    return got["sum"], got["count"]


async def requests_done(s: aiohttp.ClientSession, url: str) -> float:
    """Requests the gateway has answered (all tenants, all statuses)."""
    async with s.get(url + "/metrics") as r:
        text = await r.text()
    return sum(
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith("unbroken_gateway_requests_total{")
    )


async def run(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="unbroken-fairness-"))
    steps = FAST_STEPS if args.engine == "fast" else ("--profile", args.engine)
    eng = engine_service("--max-num-seqs", str(args.cap), *steps).start(tmp, "engine")
    await wait_http(eng.url + "/health")
    tenants = {
        "tenants": [
            {"name": "light", "api_keys": [key_digest(LIGHT)], "weight": 1},
            {"name": "greedy", "api_keys": [key_digest(GREEDY)], "weight": 1},
        ],
        "queue_timeout_s": 600,
        "max_queue": 4096,
    }
    plain = {"queue_timeout_s": 600, "max_queue": 4096}
    rows = []
    base: float | None = None
    within: float | None = None
    phases: list[tuple[str, dict[str, object], int, str | None]] = [
        ("light alone", tenants, 0, None),
        (f"light + greedy within the pool ({args.cap - 1} streams)", tenants, args.cap - 1, None),
        ("light + greedy, fair queueing", tenants, args.greedy, None),
    ]
    if args.before:
        phases.append(("light + greedy, fair queueing, before", tenants, args.greedy, args.before))
    phases.append(("light + greedy, FIFO (no tenants)", plain, args.greedy, None))
    for name, cfg, greedy, src in phases:
        path = tmp / f"gw-{len(rows)}.json"
        path.write_text(json.dumps(cfg))
        gw, _ = gateway_service(
            eng.url, args=("--config", str(path), "--cap", str(args.cap), "--workers", "1")
        )
        gw.start(tmp, f"gateway-{len(rows)}", env={"PYTHONPATH": src} if src else None)
        try:
            await wait_http(gw.url + "/health")
            await asyncio.sleep(2.0)  # the endpoint is warmed up and ready
            async with aiohttp.ClientSession() as s:
                e0 = await engine_ttft(s, eng.url)
                r0 = await requests_done(s, gw.url)
            assert gw.proc is not None
            c0 = tree_cpu_seconds(gw.proc.pid)
            # FIFO: each light request waits ~2 s behind the backlog; 60 of them tell as much.
            n = args.light if cfg is tenants else min(args.light, 60)
            got = await phase(gw.url, n, greedy, args.max_tokens)
            async with aiohttp.ClientSession() as s:
                waits = await light_waits(s, gw.url)
                e1 = await engine_ttft(s, eng.url)
                r1 = await requests_done(s, gw.url)
            cpu_ms = (tree_cpu_seconds(gw.proc.pid) - c0) / max(r1 - r0, 1) * 1000
            eng_ms = (e1[0] - e0[0]) / max(e1[1] - e0[1], 1) * 1000
        finally:
            gw.stop()
        p50, p99 = (percentile(got, 50) or 0.0) * 1000, (percentile(got, 99) or 0.0) * 1000
        base = p99 if base is None else base
        within = p99 if within is None and greedy else within
        rows.append(
            [
                name,
                str(len(got)),
                f"{p50:.1f}",
                f"{p99:.1f}",
                f"{p99 / base:.2f}x",
                "-" if within is None else f"{p99 / within:.2f}x",
                "-" if waits is None else f"{waits[0]:.1f}",
                "-" if waits is None else str(waits[1]),
                f"{eng_ms:.1f}",
                f"{cpu_ms:.2f}",
            ]
        )
    eng.stop()
    print(
        f"greedy: {args.greedy} streams in flight ({args.max_tokens} tokens each), cap "
        f"{args.cap}; light: {args.light} streams of 8 tokens, one at a time; engine steps: "
        f"{args.engine}"
    )
    print(
        table(
            [
                "phase",
                "light n",
                "TTFT p50 ms",
                "TTFT p99 ms",
                "p99 / alone",
                "p99 / within",
                "mean slot wait ms",
                "waited > 1 ms",
                "engine TTFT mean ms",
                "gateway CPU ms / request",
            ],
            rows,
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # 200: a p99 of 60 samples is their largest, one hiccup of a shared machine.
    ap.add_argument("--light", type=int, default=200)
    ap.add_argument("--greedy", type=int, default=300)
    ap.add_argument("--cap", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument(
        "--engine",
        choices=("fast", "fp16", "fp8"),
        default="fast",
        help="the engine's step model: fast (5 ms + 0.1 ms a sequence) or a simulator profile",
    )
    ap.add_argument("--before", help="a source tree (its src/) to run the gateway from, once more")
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
