"""The agent process: discovery loop, tracers (or the sock_diag fallback), Prometheus
exporter, and a clean exit that leaves no BPF program or link behind."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from unbroken.agent import libbpf
from unbroken.agent.build import BuildError, build_objects
from unbroken.agent.cuda import CudaTracer, LibraryProbes
from unbroken.agent.discovery import (
    PodResolver,
    ProcInfo,
    cuda_libraries,
    process_info,
    supervisor_endpoints,
)
from unbroken.agent.maps import MAX_SLOTS
from unbroken.agent.tcp import SockDiagSampler, TcpTracer

__all__ = ["Agent", "AgentConfig", "run_agent"]

log = logging.getLogger("unbroken.agent")
BUCKETS = [2 ** (i + 1) / 1e9 for i in range(MAX_SLOTS)]  # slot i: [2^i, 2^(i+1)) ns


@dataclass
class AgentConfig:
    host: str = "127.0.0.1"
    port: int = 9101
    interval: float = 1.0
    threshold: float = 0.8
    allow_slow_probes: bool = False
    ebpf: bool = True


@dataclass
class Agent:
    cfg: AgentConfig
    cuda: CudaTracer | None = None
    tcp: TcpTracer | SockDiagSampler | None = None
    ebpf_error: str | None = None
    procs: dict[int, ProcInfo] = field(default_factory=dict)
    cuda_pids: set[int] = field(default_factory=set)
    libraries: list[LibraryProbes] = field(default_factory=list)
    pods: PodResolver = field(default_factory=PodResolver)
    endpoints: dict[int, str] = field(default_factory=dict)

    def start(self) -> None:
        if self.cfg.ebpf:
            try:
                if os.geteuid() != 0:
                    raise PermissionError(
                        "not root: loading BPF programs needs CAP_BPF and "
                        "CAP_PERFMON (and CAP_SYS_ADMIN for uprobes here)"
                    )
                objs = build_objects()
                self.cuda = CudaTracer(objs["cuda"], allow_slow=self.cfg.allow_slow_probes)
                self.tcp = TcpTracer(objs["tcp"], self.cfg.threshold)
            except (BuildError, libbpf.BpfError, PermissionError, OSError) as e:
                self.close()
                self.ebpf_error = str(e)
        else:
            self.ebpf_error = "eBPF disabled (--no-ebpf)"
        if self.tcp is None:
            log.warning(
                "eBPF unavailable (%s): CUDA metrics off, TCP backpressure from sock_diag sampling",
                self.ebpf_error,
            )
            self.tcp = SockDiagSampler(self.cfg.threshold)
        else:
            log.info("eBPF tracers loaded (libbpf %s)", libbpf.libbpf_version())

    async def discover(self) -> None:
        loop = asyncio.get_running_loop()
        libs = await loop.run_in_executor(None, cuda_libraries)
        if self.cuda is not None:
            for paths in libs.values():
                for path in paths:
                    rep = self.cuda.attach_library(path)
                    if rep is not None:
                        self.libraries.append(rep)
        self.endpoints = await supervisor_endpoints()
        self.cuda_pids = set(libs)
        wanted = self.cuda_pids | set(self.endpoints)
        if self.pods.wants(wanted - set(self.procs)):
            await loop.run_in_executor(None, self.pods.refresh)
        for pid in wanted:
            if pid not in self.procs or self.procs[pid].endpoint != self.endpoints.get(pid, ""):
                self.procs[pid] = process_info(pid, self.pods, self.endpoints)
        gone = {pid for pid in self.procs if not os.path.exists(f"/proc/{pid}")}
        for pid in gone:
            self.procs.pop(pid, None)
        if gone:
            if self.cuda is not None:
                self.cuda.forget(gone)
            if self.tcp is not None:
                self.tcp.forget(gone)
        if isinstance(self.tcp, SockDiagSampler):
            await loop.run_in_executor(None, self.tcp.sample)

    def info(self, pid: int) -> ProcInfo:
        p = self.procs.get(pid)
        if p is None:
            p = process_info(pid, self.pods, self.endpoints)
            if os.path.exists(f"/proc/{pid}"):
                self.procs[pid] = p
        return p

    def close(self) -> None:
        if self.cuda is not None:
            self.cuda.close()
            self.cuda = None
        if self.tcp is not None:
            self.tcp.close()
            self.tcp = None


class _Collector(Collector):
    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    def collect(self) -> Iterator[Any]:
        a = self.agent
        labels = ["function", "pid", "endpoint", "pod", "namespace", "container"]
        if a.cuda is not None:
            hist = HistogramMetricFamily(
                "unbroken_cuda_call_duration_seconds",
                "Host-side duration of CUDA runtime and driver calls (uprobes; log2 buckets).",
                labels=labels,
            )
            calls = CounterMetricFamily("unbroken_cuda_calls", "CUDA calls seen.", labels=labels)
            for (pid, fn), st in sorted(a.cuda.read().items()):
                p = a.info(pid)
                lv = [fn, str(pid), p.endpoint, p.pod, p.namespace, p.container]
                cum, buckets = 0, []
                for le, n in zip(BUCKETS, st.slots, strict=True):
                    cum += n
                    buckets.append((repr(le), cum))
                buckets.append(("+Inf", st.count))
                hist.add_metric(lv, buckets, st.sum_ns / 1e9)
                calls.add_metric(lv, st.count)
            yield hist
            yield calls
            probes = GaugeMetricFamily(
                "unbroken_agent_probes",
                "Traced functions per library (mode: attached, or "
                "skipped because the probe would be single-stepped).",
                labels=["library", "function", "prologue", "mode"],
            )
            for rep in a.libraries:
                lib = os.path.basename(rep.path)
                for pr in rep.attached:
                    probes.add_metric([lib, pr.function, pr.prologue, "attached"], 1)
                for pr in rep.skipped:
                    probes.add_metric([lib, pr.function, pr.prologue, "skipped"], 1)
            yield probes
        if a.tcp is not None:
            src = a.tcp.source
            tl = ["pid", "endpoint", "pod", "namespace", "container", "source"]
            fill = GaugeMetricFamily(
                "unbroken_socket_send_buffer_fill_ratio",
                "Latest sk_wmem_queued / sk_sndbuf of the process's TCP sends (0..1).",
                labels=tl,
            )
            peak = GaugeMetricFamily(
                "unbroken_socket_send_buffer_fill_ratio_peak",
                "Peak fill ratio since the agent started.",
                labels=tl,
            )
            bp = CounterMetricFamily(
                "unbroken_socket_backpressure_seconds",
                f"Socket-seconds at or above {a.cfg.threshold:.0%} full.",
                labels=tl,
            )
            rw = CounterMetricFamily(
                "unbroken_socket_rwnd_limited_seconds",
                "Time limited by the peer's receive window (tcpi_rwnd_limited; sock_diag only).",
                labels=tl,
            )
            for pid, t in sorted(a.tcp.read().items()):
                if pid not in a.procs and t.peak_ratio < a.cfg.threshold:
                    continue  # unknown and never pressed: keep cardinality low
                p = a.info(pid)
                lv = [str(pid), p.endpoint, p.pod, p.namespace, p.container, src]
                fill.add_metric(lv, t.fill_ratio)
                peak.add_metric(lv, t.peak_ratio)
                bp.add_metric(lv, t.backpressure_s)
                if t.rwnd_limited_s is not None:
                    rw.add_metric(lv, t.rwnd_limited_s)
            yield from (fill, peak, bp, rw)
        up = GaugeMetricFamily("unbroken_agent_ebpf", "1 when the eBPF tracers are loaded.")
        up.add_metric([], 1 if a.cuda is not None else 0)
        yield up
        n = GaugeMetricFamily("unbroken_agent_processes", "CUDA processes seen.")
        n.add_metric([], len(a.cuda_pids))
        yield n


def build_app(agent: Agent) -> web.Application:
    reg = CollectorRegistry()
    reg.register(_Collector(agent))

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(reg), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def health(request: web.Request) -> web.Response:
        return web.json_response(
            {
                "ebpf": agent.cuda is not None,
                "ebpf_error": agent.ebpf_error,
                "cuda_processes": sorted(agent.cuda_pids),
            }
        )

    async def probes(request: web.Request) -> web.Response:
        return web.json_response(
            [
                {
                    "library": r.path,
                    "error": r.error,
                    "attached": [vars(p) for p in r.attached],
                    "skipped": [vars(p) for p in r.skipped],
                }
                for r in agent.libraries
            ]
        )

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    app.router.add_get("/probes", probes)
    return app


async def serve(cfg: AgentConfig) -> None:
    from unbroken.wire.http import start_site

    agent = Agent(cfg)
    agent.start()
    runner = await start_site(build_app(agent), cfg.host, cfg.port)
    log.info("agent exporter on http://%s:%d/metrics", cfg.host, cfg.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        while not stop.is_set():
            t0 = time.monotonic()
            await agent.discover()
            try:
                await asyncio.wait_for(
                    stop.wait(), max(0.05, cfg.interval - (time.monotonic() - t0))
                )
            except TimeoutError:
                pass
    finally:
        await runner.cleanup()
        agent.close()
        log.info("agent stopped; BPF programs and links released")


def run_agent(cfg: AgentConfig) -> None:
    asyncio.run(serve(cfg))
