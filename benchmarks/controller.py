"""How fast the controller reacts to contention: onset → condition change → first re-routed
request, over repeated episodes, with the agent's eBPF signal path and with engine metrics
alone, in the same run.

Each pass runs the default pipeline (`unbroken up`: 2 fp16 + 1 fp8 simulated replicas,
gateway, controller; the agent too in the eBPF pass, which needs root and BTF) under a closed
loop of streaming users sending standard-priority requests. An episode injects `slow_cuda` into
primary-1 through the engine's admin API (onset = when the engine accepted it), polls the
gateway's admin listing every 10 ms for the endpoint's `condition`, and finds the first
standard request started after the onset that the gateway served from the fp8 pool. Then the
fault is cleared and the next episode waits until every setting is restored.

    python benchmarks/controller.py [--episodes 8] [--users 12] [--extra-ms 10]

The baseline row is what the seed article starts from: a Prometheus scrape every 15 s
(detection then takes at least one scrape interval, 7.5 s on average before any rule runs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import aiohttp

from _common import UpPipeline, cpu_seconds, table
from unbroken.bench.stats import percentile
from unbroken.clients import EngineAdmin, GatewayAdmin
from unbroken.config.paths import engine_token

SPEC = """
pools:
  - {name: primary, precision: fp16, replicas: 2}
  - {name: fallback, precision: fp8, replicas: 1}
controller:
  # Recovery is sped up so that episodes repeat quickly; detection settings are the defaults.
  exit_dwell_s: 1.0
  min_dwell_s: 1.0
  recover_step_s: 0.3
"""


class Pipeline(UpPipeline):
    def __init__(self, tmp: Path, agent: bool) -> None:
        super().__init__(tmp, SPEC, "ebpf" if agent else "engine", agent=agent)


class Users:
    """Closed-loop streaming users; each request records (start, endpoint)."""

    def __init__(self, url: str, n: int) -> None:
        self.url = url
        self.served: list[tuple[float, str]] = []
        self.errors = 0
        self._tasks = [asyncio.create_task(self._user(i)) for i in range(n)]

    async def _user(self, i: int) -> None:
        body = {"model": "unbroken-sim", "prompt": f"user {i}", "max_tokens": 40, "stream": True}
        hdr = {"x-unbroken-priority": "standard"}
        async with aiohttp.ClientSession() as s:
            while True:
                t0 = time.time()
                try:
                    async with s.post(self.url + "/v1/completions", json=body, headers=hdr) as r:
                        ep = r.headers.get("x-unbroken-endpoint", "")
                        async for _ in r.content.iter_any():
                            pass
                        if r.status == 200:
                            self.served.append((t0, ep))
                        else:
                            self.errors += 1
                except aiohttp.ClientError:
                    self.errors += 1
                    await asyncio.sleep(0.1)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def _controller_pid(p: Pipeline) -> int:
    """The controller's pid, from the supervisor's status (it starts after the engines)."""
    deadline = time.monotonic() + 30
    while True:
        out = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "unbroken", "status", "--json"],
            env=p.env, capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        try:
            pid = json.loads(out.stdout)["controller"]["pid"]
        except (ValueError, KeyError, TypeError):
            pid = None
        if pid:
            return int(pid)
        if time.monotonic() > deadline:
            raise SystemExit(f"no controller pid in the status: {out.stdout[:300]}")
        await asyncio.sleep(0.5)


async def _json(s: aiohttp.ClientSession, url: str) -> Any:
    async with s.get(url) as r:
        return await r.json()


async def one_pass(tmp: Path, agent: bool, episodes: int, users: int, extra_ms: float) -> dict:
    p = Pipeline(tmp, agent)
    try:
        await p.wait()
        token = (p.state / "admin-token").read_text().strip()
        gw = GatewayAdmin(f"http://127.0.0.1:{p.admin_port}", token)
        eps = {e["name"]: e for e in await gw.endpoints()}
        victim, fallback = "primary-1", "fallback-1"
        eng = EngineAdmin(eps[victim]["url"], engine_token(p.state))
        load = Users(p.url, users)
        path = "?"
        ctl_pid = await _controller_pid(p)
        cpu0, wall0 = cpu_seconds(ctl_pid), time.monotonic()
        async with aiohttp.ClientSession() as s:
            deadline = time.monotonic() + 60
            while True:  # baselines learned (and the agent live, in the eBPF pass)
                try:
                    st = await _json(s, p.ctl + "/state")
                except aiohttp.ClientError:  # the controller is still starting
                    st = {"endpoints": {}}
                e = st["endpoints"].get(victim) or {}
                if e.get("ratio") is not None and (not agent or e.get("source") == "cuda"):
                    path = e["source"]
                    break
                if time.monotonic() > deadline:
                    raise SystemExit(f"no baseline after 60 s: {st}")
                await asyncio.sleep(0.2)
            await asyncio.sleep(2.0)
            to_condition, to_reroute = [], []
            for k in range(episodes):
                t0 = time.time()
                await eng.inject(kind="slow_cuda", extra_ms=extra_ms)
                t_on = (t0 + time.time()) / 2  # the engine applied it within this round trip
                while True:
                    cur = {e["name"]: e for e in await gw.endpoints()}
                    if cur[victim]["condition"] == "contended":
                        t1 = time.time()
                        break
                    if time.time() - t_on > 30:
                        raise SystemExit(f"episode {k}: not detected in 30 s")
                    await asyncio.sleep(0.01)
                while True:
                    moved = [t for t, ep in load.served if t >= t_on and ep == fallback]
                    if moved:
                        t2 = min(moved)
                        break
                    await asyncio.sleep(0.05)
                to_condition.append(t1 - t_on)
                to_reroute.append(t2 - t_on)
                await eng.clear()
                while True:
                    cur = {e["name"]: e for e in await gw.endpoints()}
                    if cur[victim]["condition"] == "normal" and cur[victim]["cap_override"] is None:
                        break
                    await asyncio.sleep(0.05)
                await asyncio.sleep(1.5)
                print(
                    f"  {'ebpf' if agent else 'engine'} episode {k + 1}/{episodes}: "
                    f"condition {to_condition[-1]:.2f} s, re-routed {to_reroute[-1]:.2f} s",
                    flush=True,
                )
        cpu = (cpu_seconds(ctl_pid) - cpu0) / (time.monotonic() - wall0)
        await load.stop()
        await gw.close()
        await eng.close()
        return {
            "path": path,
            "condition": to_condition,
            "reroute": to_reroute,
            "controller_cpu": cpu,
            "requests": len(load.served),
            "errors": load.errors,
        }
    finally:
        p.stop()


def pct(xs: list[float], q: float) -> float:
    v = percentile(xs, q)
    return float("nan") if v is None else v


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--users", type=int, default=12)
    ap.add_argument("--extra-ms", type=float, default=10.0)
    ap.add_argument("--json", type=Path, help="also write the raw figures here")
    a = ap.parse_args()
    root = os.geteuid() == 0 and Path("/sys/kernel/btf/vmlinux").exists()
    tmp = Path(tempfile.mkdtemp(prefix="unbroken-ctlbench-"))
    results: dict[str, dict] = {}
    if root:
        results["ebpf"] = await one_pass(tmp, True, a.episodes, a.users, a.extra_ms)
    else:
        print("not root or no BTF: the eBPF pass is skipped (engine metrics only)")
    results["engine"] = await one_pass(tmp, False, a.episodes, a.users, a.extra_ms)
    scrape = 7.5  # the seed's baseline: mean wait for the next 15 s scrape, before any rule
    rows = []
    for name, r in results.items():
        c, rr = r["condition"], r["reroute"]
        rows.append(
            [
                {"ebpf": "agent (eBPF uprobes)", "engine": "engine metrics only"}[name]
                + f" [{r['path']}]",
                str(len(c)),
                f"{pct(c, 50):.2f}",
                f"{pct(c, 99):.2f}",
                f"{pct(rr, 50):.2f}",
                f"{pct(rr, 99):.2f}",
                f"{scrape / pct(rr, 50):.1f}x",
                f"{r['controller_cpu'] * 100:.1f} %",
                f"{r['errors']} of {r['requests'] + r['errors']}",
            ]
        )
    rows.append(["15 s Prometheus scrape (seed baseline)", "-", ">= 7.5", ">= 15", "-", "-",
                 "1.0x", "-", "-"])  # fmt: skip
    print(
        f"\ncontroller detection, {a.episodes} episodes of slow_cuda +{a.extra_ms:g} ms per "
        f"call on primary-1, {a.users} users; {platform.node()}, {os.cpu_count()} cores\n"
    )
    print(
        table(
            [
                "signal path",
                "episodes",
                "→ condition p50 s",
                "p99 s",
                "→ re-routed p50 s",
                "p99 s",
                "faster than a scrape (p50)",
                "controller CPU",
                "failed requests",
            ],
            rows,
        )
    )
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
