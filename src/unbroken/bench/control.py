"""What a scenario does to a running pipeline, through the supervisor's control socket and
the gateway's admin API (the same calls `unbroken rollout` and `unbroken status` make)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import aiohttp

from unbroken.clients import AdminError, GatewayAdmin
from unbroken.pipeline.control import SupervisorClient, SupervisorRejected

__all__ = ["PipelineControl", "Sampler"]


class PipelineControl:
    def __init__(self, control_socket: str) -> None:
        self.socket = control_socket
        self.client = SupervisorClient(control_socket)

    async def status(self) -> dict[str, Any]:
        return await self.client.status()

    async def rollout(
        self, pool: str, engine: dict[str, Any], *, deadline_s: float, warmup_budget_s: float = 10.0
    ) -> dict[str, Any]:
        body = {
            "pool": pool,
            "engine": engine,
            "drain_deadline_s": deadline_s,
            "warmup_budget_s": warmup_budget_s,
        }
        try:
            return await self.client.rollout(body)
        except SupervisorRejected as e:
            return {"ok": False, "error": str(e)}

    async def kill(self, pool: str) -> dict[str, Any]:
        """SIGKILL one replica of `pool` (the oldest), as a crash would."""
        st = await self.status()
        victims = sorted(
            (r for r in st["replicas"] if r["pool"] == pool and r["alive"]),
            key=lambda r: r["started_at"],
        )
        if not victims:
            raise RuntimeError(f"no live replica in pool {pool!r}")
        v = victims[0]
        os.kill(v["pid"], signal.SIGKILL)
        return v

    async def wait_replaced(self, name: str, timeout: float = 60) -> str | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = await self.status()
            for e in reversed(st.get("events", [])):
                if e.get("event") == "replica_replaced" and e.get("replica") == name:
                    return e.get("by")
            await asyncio.sleep(0.25)
        return None


class Sampler:
    """Polls the gateway: in-flight streams per endpoint and queue depth (admin API), and
    the migrated/dropped stream counters (its /metrics), over time."""

    COUNTERS = {
        "migrated": "unbroken_gateway_streams_migrated_total",
        "dropped": "unbroken_gateway_streams_dropped_total",
    }

    def __init__(self, admin_url: str, token: str, interval: float = 0.5) -> None:
        self.admin = GatewayAdmin(admin_url, token, timeout=5)
        self.interval = interval
        self.samples: list[dict[str, Any]] = []
        self._task: asyncio.Task[None] | None = None

    def start(self, t0: float) -> None:
        self._task = asyncio.create_task(self._loop(t0))

    async def _counters(self, session: aiohttp.ClientSession, url: str) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families

        try:
            async with session.get(url) as r:
                text = await r.text()
        except (aiohttp.ClientError, TimeoutError, ConnectionError):
            return {}
        want = {v.removesuffix("_total"): k for k, v in self.COUNTERS.items()}
        out = dict.fromkeys(self.COUNTERS, 0.0)
        for fam in text_string_to_metric_families(text):
            if fam.name in want:
                out[want[fam.name]] = sum(s.value for s in fam.samples if s.name.endswith("_total"))
        return out

    async def _loop(self, t0: float) -> None:
        metrics_url = None
        timeout = aiohttp.ClientTimeout(total=5)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                try:
                    st = await self.admin.status()
                    if metrics_url is None and st.get("listen"):
                        metrics_url = (
                            st["listen"].replace("//0.0.0.0:", "//127.0.0.1:") + "/metrics"
                        )
                    sample: dict[str, Any] = {
                        "t": round(time.monotonic() - t0, 3),
                        "endpoints": {
                            e["name"]: {
                                "inflight": e["inflight"],
                                "state": e["state"],
                                "pool": e["pool"],
                                **({"condition": e["condition"]} if "condition" in e else {}),
                            }
                            for e in st.get("endpoints", [])
                        },
                        "queue": dict(st.get("queue") or {}),
                    }
                    if metrics_url is not None:
                        sample["counters"] = await self._counters(session, metrics_url)
                    self.samples.append(sample)
                except AdminError:
                    pass
                await asyncio.sleep(self.interval)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.admin.close()
