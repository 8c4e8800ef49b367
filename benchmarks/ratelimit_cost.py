"""What a tenant's limits cost per request, in process: `Limiter.admit` plus `finish` (with
a token charge) against the workers' shared table (local mode) and against a redis-server on
localhost (redis mode: one script round trip at admission; charges and ends batched after).

    python benchmarks/ratelimit_cost.py [--n 3000]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _common import table
from unbroken.config.tenants import RateLimitSettings, TenantSpec
from unbroken.gateway._ratelimit import Limiter, TenantTable
from unbroken.wire.http import free_port

LIMITS = {
    "requests_per_minute": 10**9,
    "prompt_tokens_per_minute": 10**9,
    "completion_tokens_per_minute": 10**9,
    "concurrent_streams": 10**6,
}


async def measure(lim: Limiter, n: int) -> tuple[float, float]:
    """(mean, p99) microseconds per admit + finish."""
    for _ in range(50):  # warm up (connection, scripts)
        lease = await lim.admit("t")
        lim.finish(lease, 10, 20)
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        lease = await lim.admit("t")
        lim.finish(lease, 10, 20)
        out.append(time.perf_counter() - t0)
        await asyncio.sleep(0)  # let the batched flush run, as between requests
    out.sort()
    return sum(out) / n * 1e6, out[int(n * 0.99)] * 1e6


async def run(n: int) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="unbroken-rl-"))
    spec = [TenantSpec(name="t", limits=LIMITS)]  # type: ignore[arg-type]
    rows = []
    table_ = TenantTable(tmp / "tenants", create=True)
    local = Limiter(spec, RateLimitSettings(), table_, {"t": 0})
    mean, p99 = await measure(local, n)
    rows.append(["local (shared table, lockf)", f"{mean:.1f}", f"{p99:.1f}"])
    exe = shutil.which("redis-server")
    if exe is None:
        rows.append(["redis", "redis-server not installed", ""])
    else:
        port = free_port()
        proc = subprocess.Popen(  # noqa: ASYNC220 - a benchmark, started once
            [exe, "--port", str(port), "--save", "", "--appendonly", "no", "--dir", str(tmp)],
            stdout=subprocess.DEVNULL,
        )
        try:
            await asyncio.sleep(0.5)
            settings = RateLimitSettings(
                store="redis", redis_url=f"redis://127.0.0.1:{port}/0", redis_timeout_s=1.0
            )
            remote = Limiter(spec, settings, TenantTable(tmp / "t2", create=True), {"t": 0})
            mean, p99 = await measure(remote, n)
            assert remote.store is not None and not remote.table.flags[0]
            rows.append(["redis (localhost)", f"{mean:.1f}", f"{p99:.1f}"])
            await remote.close()
        finally:
            proc.kill()
    print(f"{n} requests, one at a time, admit + finish (with a token charge)")
    print(table(["store", "mean us", "p99 us"], rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=3000)
    asyncio.run(run(ap.parse_args().n))


if __name__ == "__main__":
    main()
