"""Engine start with a cold page cache versus after `unbroken prewarm`, measured for real."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp

from unbroken.prewarm import evict, find_weight_files, warm_files
from unbroken.wire.http import wait_ok

__all__ = ["engine_start", "measure_cold_start"]


async def engine_start(argv: list[str], url: str, timeout: float = 120.0) -> tuple[float, float]:
    """Start an engine; (seconds from spawn to /health 200, weight-load seconds it reports)."""
    t0 = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
    )

    def alive() -> None:
        if proc.returncode is not None:
            raise RuntimeError(f"engine exited with {proc.returncode} while starting")

    try:
        async with aiohttp.ClientSession() as s:
            await wait_ok(s, url + "/health", timeout=timeout, interval=0.01, check=alive)
            took = time.monotonic() - t0
            async with s.get(url + "/metrics") as r:
                text = await r.text()
        load = next(
            float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith("unbroken_engine_weights_load_seconds")
        )
        return took, load
    finally:
        if proc.returncode is None:
            proc.terminate()
        await proc.wait()


async def measure_cold_start(
    argv: list[str], url: str, weights: Path, repeats: int = 1
) -> dict[str, float]:
    """Start the engine `argv` (serving on `url`) with its weights evicted, then right after a
    pre-warm; medians over `repeats`. Seconds to /health and the weight-load part of each."""
    files = find_weight_files([str(weights)])
    loop = asyncio.get_running_loop()
    cold: list[tuple[float, float]] = []
    warm: list[tuple[float, float]] = []
    prewarm_s: list[float] = []
    for _ in range(repeats):
        for f in files:
            evict(f)
        cold.append(await engine_start(argv, url))
        for f in files:
            evict(f)
        stats = await loop.run_in_executor(None, warm_files, files)
        prewarm_s.append(stats.seconds)
        warm.append(await engine_start(argv, url))

    def med(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2]

    return {
        "bytes": float(sum(f.stat().st_size for f in files)),
        "cold_start_s": med([c[0] for c in cold]),
        "cold_load_s": med([c[1] for c in cold]),
        "warm_start_s": med([w[0] for w in warm]),
        "warm_load_s": med([w[1] for w in warm]),
        "prewarm_s": med(prewarm_s),
    }
