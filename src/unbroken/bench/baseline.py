"""The standard deployment the demo measures unbroken against: what a team runs without it.

- The same engines (the simulator, same pools, profiles and weights) as unbroken's pipeline,
  started with vLLM's default shutdown behaviour: `--shutdown-timeout 0`, so SIGTERM aborts
  the requests in flight (vLLM PR #36666: "immediate termination by default").
- Behind a Kubernetes Service: an L4 round-robin proxy (`rrproxy`) over every ready replica,
  no retries, no drain, no migration, no priorities, no controller.
- Weights from network storage: before every replica start after the first, the weight files
  are dropped from the page cache (each pod reads them anew; nothing pre-warms them).
- A rollout is `kubectl rollout restart` with the seed manifest's strategy (maxSurge 1,
  maxUnavailable 0): start the new pod, wait for its readiness probe (`/health`, polled as
  often as unbroken polls it, so the baseline is not slowed by a 5 s probe period), add it to
  the Service, remove the old one from the Service and SIGTERM it.
- A crashed replica is removed from the Service at once and replaced (a ReplicaSet).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from unbroken.bench.throttle import drop_page_cache
from unbroken.config.spec import PipelineSpec
from unbroken.pipeline.rollout import new_engine
from unbroken.pipeline.supervisor import Replica, Supervisor
from unbroken.prewarm import find_weight_files
from unbroken.wire.http import free_port

__all__ = ["StandardDeployment"]


def _die_with_parent() -> None:
    """preexec_fn: the proxy gets SIGTERM if the demo dies, even by SIGKILL."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class StandardDeployment:
    def __init__(self, spec: PipelineSpec, *, state: Path, token: str, token_file: Path) -> None:
        spec = spec.model_copy(deep=True)
        for pool in spec.pools:
            pool.engine.shutdown_timeout_s = 0.0
            pool.engine.startup_nice = 0  # a plain Deployment's pods start at normal priority
            pool.engine.startup_cpu = 0.0  # and with no quota of their own
        self.spec = spec
        self.state = state
        # The supervisor is used only to launch and stop engine processes: no gateway.
        self.sup = Supervisor(spec, state=state, token=token, token_file=token_file, restart=False)
        self.sup.engine_token = token  # the engines' admin API (fault injection)
        self.token = token
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.backends_file = state / "service-endpoints.json"
        self._generation = 0
        self._proxy: asyncio.subprocess.Process | None = None
        self._service: list[Replica] = []
        self.events: list[dict[str, Any]] = []
        self.cold_starts: list[dict[str, Any]] = []
        self._watches: set[asyncio.Task[None]] = set()
        self._stopping = False

    @property
    def replicas(self) -> dict[str, Replica]:
        return self.sup.replicas

    def record(self, kind: str, **data: Any) -> None:
        self.events.append({"t": time.time(), "event": kind, **data})

    # -- the Service --------------------------------------------------------------------------
    async def _publish(self) -> None:
        """Write the Service's endpoints and wait until the proxy has them (an Endpoints update
        that has reached kube-proxy)."""
        self._generation += 1
        body = {"backends": [r.url for r in self._service], "generation": self._generation}
        tmp = self.backends_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(body))
        tmp.replace(self.backends_file)
        if self._proxy is None:
            return
        ack = self.backends_file.with_name(self.backends_file.name + ".ack")
        self._proxy.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError):
                if int(ack.read_text()) >= self._generation:
                    return
            await asyncio.sleep(0.01)

    async def _add(self, r: Replica) -> None:
        self._service.append(r)
        await self._publish()

    async def _remove(self, r: Replica) -> None:
        if r in self._service:
            self._service.remove(r)
            await self._publish()

    # -- replicas -------------------------------------------------------------------------------
    def _weight_files(self, r_pool: Any) -> list[Path]:
        w = self.sup.weights_for(r_pool)
        return find_weight_files([str(w)]) if w is not None else []

    async def _start(self, pool: Any, *, reason: str, cold: bool = True) -> Replica:
        """Start one replica; with `cold`, its weights come from 'network storage' (evicted
        from the page cache first). Records start → ready."""
        if cold:
            await asyncio.get_running_loop().run_in_executor(
                None, drop_page_cache, self._weight_files(pool)
            )
        r = await self.sup.start_replica(pool)
        await self.sup.wait_health(r)
        assert r.healthy_at is not None
        self.cold_starts.append(
            {
                "replica": r.name,
                "reason": reason,
                "cold": cold,
                "start_to_ready_s": round(r.healthy_at - r.started_at, 3),
            }
        )
        self._watch(r)
        return r

    def _watch(self, r: Replica) -> None:
        t = asyncio.create_task(self._on_exit(r))
        self._watches.add(t)
        t.add_done_callback(self._watches.discard)

    async def _on_exit(self, r: Replica) -> None:
        """A ReplicaSet: a pod that dies leaves the Service and a new one is started."""
        assert r.proc is not None
        code = await r.proc.wait()
        if self._stopping or r.stopping:
            return
        self.record("replica_died", replica=r.name, code=code)
        self.sup.replicas.pop(r.name, None)
        await self._remove(r)
        new = await self._start(r.pool, reason="replace crashed")
        await self._add(new)
        self.record("replica_replaced", replica=r.name, by=new.name, pid=new.pid)

    async def start(self, progress: Callable[[str], None] | None = None) -> None:
        say = progress or (lambda _m: None)
        self.state.mkdir(parents=True, exist_ok=True)
        await asyncio.get_running_loop().run_in_executor(None, self.sup.prepare_weights, say)
        say("starting the standard deployment's engines")
        first = await asyncio.gather(
            *(
                self._start(p, reason="initial", cold=False)
                for p in self.spec.pools
                for _ in range(p.replicas)
            )
        )
        self._service = list(first)
        await self._publish()
        say("starting the round-robin Service proxy")
        self._proxy = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "unbroken.bench.rrproxy",
            "--listen",
            f"127.0.0.1:{self.port}",
            "--backends",
            str(self.backends_file),
            stdin=asyncio.subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        ack = self.backends_file.with_name(self.backends_file.name + ".ack")
        deadline = time.monotonic() + 30
        while not ack.exists():
            if self._proxy.returncode is not None or time.monotonic() > deadline:
                raise RuntimeError("the round-robin proxy did not start")
            await asyncio.sleep(0.05)

    # -- what the demo does to it ----------------------------------------------------------------
    async def rollout(self, pool_name: str, engine: dict[str, Any]) -> dict[str, Any]:
        """`kubectl rollout restart` (maxSurge 1, maxUnavailable 0) with a default engine."""
        pool = next(p for p in self.spec.pools if p.name == pool_name)
        new_pool = pool.model_copy(update={"engine": new_engine(pool.engine, engine)})
        olds = [r for r in self.sup.replicas.values() if r.pool.name == pool_name]
        t0 = time.monotonic()
        steps = []
        for old in olds:
            new = await self._start(new_pool, reason="rollout")
            await self._add(new)
            await self._remove(old)
            code = await self.sup.stop_replica(old, timeout=15)
            steps.append(
                {
                    "old": old.name,
                    "new": new.name,
                    "start_to_ready_s": self.cold_starts[-1]["start_to_ready_s"],
                    "exit_code": code,
                }
            )
            self.record("rollout_replaced", old=old.name, new=new.name)
        self.spec.pools[self.spec.pools.index(pool)] = new_pool
        return {"ok": True, "seconds": round(time.monotonic() - t0, 3), "steps": steps}

    async def kill(self, pool: str) -> dict[str, Any]:
        """SIGKILL the oldest replica of `pool`."""
        victims = sorted(
            (r for r in self.sup.replicas.values() if r.pool.name == pool and not r.stopping),
            key=lambda r: r.started_at,
        )
        v = victims[0]
        assert v.proc is not None
        v.proc.kill()
        return {"name": v.name, "pid": v.pid}

    async def wait_replaced(self, name: str, timeout: float = 60) -> str | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for e in reversed(self.events):
                if e["event"] == "replica_replaced" and e["replica"] == name:
                    return str(e["by"])
            await asyncio.sleep(0.1)
        return None

    async def stop(self) -> None:
        self._stopping = True
        for t in list(self._watches):
            t.cancel()
        if self._proxy is not None and self._proxy.returncode is None:
            self._proxy.terminate()
            try:
                await asyncio.wait_for(self._proxy.wait(), 5)
            except TimeoutError:
                self._proxy.kill()
                await self._proxy.wait()
        await asyncio.gather(
            *(self.sup.stop_replica(r, timeout=5) for r in list(self.sup.replicas.values())),
            return_exceptions=True,
        )
        await self.sup.admin.close()
