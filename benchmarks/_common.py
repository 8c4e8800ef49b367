"""Shared pieces of the benchmark scripts: processes, load, percentiles, tables."""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson

from unbroken.wire.http import free_port
from unbroken.wire.sse import SSEDecoder

CLK = os.sysconf("SC_CLK_TCK")


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))
    return xs[k]


def cpu_seconds(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / CLK


@dataclass
class Service:
    argv: list[str]
    port: int
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, logdir: Path, name: str, env: dict[str, str] | None = None) -> Service:
        logdir.mkdir(parents=True, exist_ok=True)
        with open(logdir / f"{name}.log", "wb") as out:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                start_new_session=True,
            )
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def engine_service(*args: str) -> Service:
    port = free_port()
    return Service([sys.executable, "-m", "unbroken", "engine", "--port", str(port), *args], port)


def gateway_service(*endpoints: str, args: tuple[str, ...] = ()) -> tuple[Service, int]:
    port, admin = free_port(), free_port()
    argv = [
        sys.executable,
        "-m",
        "unbroken",
        "gateway",
        "--port",
        str(port),
        "--admin-port",
        str(admin),
        *args,
    ]
    for e in endpoints:
        argv += ["--endpoint", e]
    return Service(argv, port), admin


async def wait_http(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while True:
            try:
                async with s.get(url, timeout=aiohttp.ClientTimeout(total=1)) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(url)
            await asyncio.sleep(0.1)


@dataclass
class Sample:
    ttft: float
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    ok: bool = False
    warmup: bool = False  # started during warm-up: counted for throughput, not latency


async def one_stream(session: aiohttp.ClientSession, url: str, body: dict) -> Sample:
    t0 = time.monotonic()
    dec = SSEDecoder()
    s = Sample(ttft=float("nan"))
    last = None
    async with session.post(
        url + "/v1/completions",
        data=orjson.dumps(body),
        headers={"Content-Type": "application/json"},
    ) as r:
        async for chunk in r.content.iter_any():
            now = time.monotonic()
            for ev in dec.feed(chunk):
                if ev.data is None:
                    continue
                if ev.is_done:
                    s.ok = True
                    continue
                if b'"text":"' in ev.data and b'"text":""' not in ev.data:
                    if last is None:
                        s.ttft = now - t0
                    else:
                        s.gaps.append(now - last)
                    last = now
                    s.tokens += 1
    return s


async def closed_loop(
    url: str, users: int, duration: float, body: dict, warmup: float = 1.5
) -> list[Sample]:
    """`users` clients each streaming requests back to back for `duration` seconds; requests
    started during the first `warmup` seconds are marked `warmup`."""
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=60)
    out: list[Sample] = []
    start = time.monotonic()
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:

        async def user(i: int) -> None:
            await asyncio.sleep(i * min(0.01, warmup / max(users, 1)))
            while time.monotonic() - start < warmup + duration:
                t = time.monotonic()
                s = await one_stream(session, url, body)
                s.warmup = t - start < warmup
                out.append(s)

        await asyncio.gather(*(user(i) for i in range(users)))
    return out


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in rows
    ]
    return "\n".join([line, sep, *body])


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")
