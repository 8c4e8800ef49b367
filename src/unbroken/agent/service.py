"""The agent process: discovery loop, tracers (or the sock_diag fallback), Prometheus
exporter, and a clean exit that leaves no BPF program or link behind."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
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
from unbroken.agent.tcp import SockDiagSampler, TcpTracer
from unbroken.wire.exposition import render_text
from unbroken.wire.metrics import register_standard_metrics

__all__ = ["Agent", "AgentConfig", "run_agent"]

log = logging.getLogger("unbroken.agent")
# Kernel slot i counts calls in [2^i, 2^(i+1)) ns. Exported bounds: 2^10 ns (1 µs, below
# any real launch) to 2^32 ns (4.3 s, a long synchronize), log2 apart: 23 buckets and +Inf
# instead of 40. Faster calls land in the first bucket, slower ones only in +Inf.
FIRST_BOUND_LOG2, LAST_BOUND_LOG2 = 10, 32
BUCKETS = [2**k / 1e9 for k in range(FIRST_BOUND_LOG2, LAST_BOUND_LOG2 + 1)]
# A process discovery does not know gets TCP series once it was held back this long (or its
# send buffer reached --threshold): any process on the node sends, few matter.
PRESSED_S = 1.0
# How long the counters of a label set whose processes all exited are still exported (their
# last values): long enough for Prometheus to scrape the final increase, then dropped.
RETIRED_GRACE_S = 300.0
# A library file no process maps keeps its probes this long (a restarting engine maps it
# again), then they are destroyed.
UNMAPPED_GRACE_S = 30.0


@dataclass
class AgentConfig:
    host: str = "127.0.0.1"
    port: int = 9101
    interval: float = 1.0
    threshold: float = 0.8
    allow_slow_probes: bool = False
    ebpf: bool = True
    pid_label: bool = False  # one series per process (high cardinality) instead of per endpoint


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
    _pods_version: int = 0
    _unmapped_since: dict[tuple[int, int], float] = field(default_factory=dict)

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
                if isinstance(e, libbpf.BpfError) and e.errno == errno.EPERM:
                    # libbpf's own text blames RLIMIT_MEMLOCK, which does not matter on
                    # kernels with memcg accounting: say what is missing.
                    self.ebpf_error = (
                        f"bpf() refused (EPERM) at {e.what}: needs CAP_BPF and CAP_PERFMON "
                        "(CAP_SYS_ADMIN for uprobes)"
                    )
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
            for pid, paths in libs.items():
                for path in paths:
                    try:
                        rep = self.cuda.attach_library(path)
                    except OSError as e:
                        # The process exited between the /proc scan and the attach (short-lived
                        # engines in tests and rollouts): nothing to trace, not an agent fault.
                        log.debug("pid %d gone before attaching to %s: %s", pid, path, e)
                        continue
                    if rep is not None:
                        self.libraries.append(rep)
            await loop.run_in_executor(None, self._detach_unmapped, libs)
        names = await supervisor_endpoints()
        if names is not None and names != self.endpoints:
            # Once per change: without these names the controller gets no CUDA signal for
            # an endpoint (it falls back to the engine's ITL), so say what the agent knows.
            log.info(
                "endpoints from the supervisor: %s",
                ", ".join(f"{n} (pid {p})" for p, n in sorted(names.items())) or "none",
            )
            self.endpoints = names
        self.cuda_pids = set(libs)
        wanted = self.cuda_pids | set(self.endpoints)
        # New processes, and known ones (CUDA, endpoints, TCP-only ones the exporter labelled)
        # whose container the kubelet did not list yet: a container that started before the
        # kubelet reported it gets its pod at a later (rate-limited) fetch.
        cids = [p.cid for p in self.procs.values() if p.cid and not p.pod]
        if self.pods.wants(wanted - set(self.procs)) or self.pods.wants_cids(cids):
            await loop.run_in_executor(None, self.pods.refresh)
        if self.pods.version != self._pods_version:  # relabel every cached process
            self._pods_version = self.pods.version
            for pid in list(self.procs):
                self.procs[pid] = process_info(pid, self.pods, self.endpoints)
        for pid in wanted:
            if pid not in self.procs or self.procs[pid].endpoint != self.endpoints.get(pid, ""):
                self.procs[pid] = process_info(pid, self.pods, self.endpoints)
        gone = {pid for pid in self.procs if not os.path.exists(f"/proc/{pid}")}
        for pid in gone:
            self.procs.pop(pid, None)
        # Every exited process in the maps, not only those discovery knew: the maps are
        # bounded (a full one refuses new processes) and a dead pid's gauges must end.
        if self.cuda is not None:
            self.cuda.prune()
        if self.tcp is not None:
            self.tcp.prune()
        if isinstance(self.tcp, SockDiagSampler):
            await loop.run_in_executor(None, self.tcp.sample)

    def _detach_unmapped(self, libs: dict[int, set[str]]) -> None:
        """Detach from library files no live process has mapped for UNMAPPED_GRACE_S (an
        engine restarting maps the same file again at once: keep its probes meanwhile)."""
        if self.cuda is None:
            return
        mapped = set()
        for paths in libs.values():
            for path in paths:
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                mapped.add((st.st_dev, st.st_ino))
        now = time.monotonic()
        for key in list(self._unmapped_since):
            if key in mapped or key not in self.cuda.libraries:
                del self._unmapped_since[key]
        for key in set(self.cuda.libraries) - mapped:
            self._unmapped_since.setdefault(key, now)
        due = {k for k, t in self._unmapped_since.items() if now - t >= UNMAPPED_GRACE_S}
        if due:
            gone = {id(r) for r in self.cuda.detach(due)}
            self.libraries = [r for r in self.libraries if id(r) not in gone]
            for key in due:
                self._unmapped_since.pop(key, None)

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


def _cumulative(slots: Sequence[int]) -> list[int]:
    """Kernel log2 slots → cumulative counts at each exported bound in BUCKETS."""
    out, cum, i = [], 0, 0
    for k in range(FIRST_BOUND_LOG2, LAST_BOUND_LOG2 + 1):
        while i < len(slots) and i + 1 <= k:  # slot i ends at 2^(i+1) <= 2^k
            cum += slots[i]
            i += 1
        out.append(cum)
    return out


Labels = tuple[str, ...]


class _Monotonic:
    """Adds per-process counter vectors into series without a pid label. A process that
    exits (or is relabelled) leaves its last counts behind, so every summed counter only
    grows: a vanishing process must not look like a counter reset to Prometheus. A label set
    with no live member is dropped `grace` seconds after its last member left, so series of
    dead processes (`--pid-label`) and replaced pods do not accumulate forever."""

    def __init__(
        self, grace: float = RETIRED_GRACE_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.grace = grace
        self.clock = clock
        self.last: dict[Hashable, tuple[Labels, list[float]]] = {}
        self.retired: dict[Labels, list[float]] = {}
        self.retired_at: dict[Labels, float] = {}

    def update(
        self, current: dict[Hashable, tuple[Labels, list[float]]]
    ) -> dict[Labels, list[float]]:
        now = self.clock()
        for key, (labels, vec) in self.last.items():
            cur = current.get(key)
            if cur is None or cur[0] != labels:
                self.retired[labels] = _add(self.retired.get(labels), vec)
                self.retired_at[labels] = now
        live = {labels for labels, _ in current.values()}
        for labels in [lv for lv in self.retired if lv not in live]:
            if now - self.retired_at[labels] > self.grace:
                del self.retired[labels], self.retired_at[labels]
        self.last = current
        out = {labels: list(vec) for labels, vec in self.retired.items()}
        for labels, vec in current.values():
            out[labels] = _add(out.get(labels), vec)
        return out


def _add(a: list[float] | None, b: list[float]) -> list[float]:
    return list(b) if a is None else [x + y for x, y in zip(a, b, strict=True)]


class _Collector(Collector):
    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.cuda_sums = _Monotonic()
        self.tcp_sums = _Monotonic()

    def _who(self, pid: int) -> Labels:
        p = self.agent.info(pid)
        who = (p.endpoint, p.pod, p.namespace, p.container)
        return (str(pid), *who) if self.agent.cfg.pid_label else who

    def collect(self) -> Iterator[Any]:
        a = self.agent
        who = ["endpoint", "pod", "namespace", "container"]
        if a.cfg.pid_label:
            who = ["pid", *who]
        if a.cuda is not None:
            labels = ["function", *who]
            hist = HistogramMetricFamily(
                "unbroken_cuda_call_duration_seconds",
                "Host-side duration of CUDA runtime and driver calls (uprobes; log2 buckets).",
                labels=labels,
            )
            calls = CounterMetricFamily("unbroken_cuda_calls", "CUDA calls seen.", labels=labels)
            current: dict[Hashable, tuple[Labels, list[float]]] = {}
            for (pid, fn), st in a.cuda.read().items():
                vec = [float(st.count), float(st.sum_ns), *map(float, _cumulative(st.slots))]
                current[(pid, fn)] = ((fn, *self._who(pid)), vec)
            for lv, vec in sorted(self.cuda_sums.update(current).items()):
                count, sum_ns, cum = vec[0], vec[1], vec[2:]
                buckets = [(repr(le), n) for le, n in zip(BUCKETS, cum, strict=True)]
                buckets.append(("+Inf", count))
                hist.add_metric(list(lv), buckets, sum_ns / 1e9)
                calls.add_metric(list(lv), count)
            yield hist
            yield calls
            probes = GaugeMetricFamily(
                "unbroken_agent_probes",
                "Traced functions per library (mode: attached, or skipped because the probe "
                "would be single-stepped); the value counts the copies of that library.",
                labels=["library", "function", "prologue", "mode"],
            )
            # Labelled by the library's basename, which copies share (one per venv or
            # container image): one series per label set, counting them, not one per copy.
            copies: dict[tuple[str, str, str, str], int] = {}
            for rep in a.libraries:
                lib = os.path.basename(rep.path)
                for mode, found in (("attached", rep.attached), ("skipped", rep.skipped)):
                    for pr in found:
                        key = (lib, pr.function, pr.prologue, mode)
                        copies[key] = copies.get(key, 0) + 1
            for key, n in sorted(copies.items()):
                probes.add_metric(list(key), n)
            yield probes
        if a.tcp is not None:
            src = a.tcp.source
            tl = [*who, "source"]
            fill = GaugeMetricFamily(
                "unbroken_socket_send_buffer_fill_ratio",
                "sk_wmem_queued / sk_sndbuf now, max over the process's open TCP sockets "
                "(0..1; clamped: the queue may overshoot the buffer by one packet).",
                labels=tl,
            )
            peak = GaugeMetricFamily(
                "unbroken_socket_send_buffer_fill_ratio_peak",
                "Highest fill ratio seen since the agent started (0..1).",
                labels=tl,
            )
            bp = CounterMetricFamily(
                "unbroken_socket_backpressure_seconds",
                "Socket-seconds the kernel held the process's sends back: limited by the "
                "peer's receive window (peer not reading) or by a full send buffer "
                "(tcp_info's tcpi_rwnd_limited + tcpi_sndbuf_limited).",
                labels=tl,
            )
            rw = CounterMetricFamily(
                "unbroken_socket_rwnd_limited_seconds",
                "Socket-seconds limited by the peer's receive window (tcpi_rwnd_limited): "
                "the part of the backpressure seconds due to a peer that does not read.",
                labels=tl,
            )
            gauges: dict[Labels, tuple[float, float]] = {}
            counters: dict[Hashable, tuple[Labels, list[float]]] = {}
            for pid, t in a.tcp.read().items():
                pressed = t.peak_ratio >= a.cfg.threshold or t.backpressure_s >= PRESSED_S
                if pid not in a.procs and not pressed:
                    continue  # unknown and never pressed: keep cardinality low
                lv = (*self._who(pid), src)
                f0, p0 = gauges.get(lv, (0.0, 0.0))
                gauges[lv] = (max(f0, t.fill_ratio), max(p0, t.peak_ratio))
                counters[pid] = (lv, [t.backpressure_s, t.rwnd_limited_s or 0.0])
            for lv, (bp_s, rw_s) in sorted(self.tcp_sums.update(counters).items()):
                if lv in gauges:
                    fill.add_metric(list(lv), gauges[lv][0])
                    peak.add_metric(list(lv), gauges[lv][1])
                bp.add_metric(list(lv), bp_s)
                rw.add_metric(list(lv), rw_s)
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
    register_standard_metrics(reg, "agent")

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=render_text(reg), headers={"Content-Type": CONTENT_TYPE_LATEST})

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
    from unbroken.wire.heap import freeze_startup_heap
    from unbroken.wire.http import start_site

    agent = Agent(cfg)
    agent.start()
    freeze_startup_heap()
    try:
        runner = await start_site(build_app(agent), cfg.host, cfg.port)
    except OSError:
        agent.close()  # a port in use: release the BPF programs, then report it
        raise
    log.info("agent exporter on http://%s:%d/metrics", cfg.host, cfg.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                await agent.discover()
            except Exception:  # one bad round (a racing process, a kubelet hiccup) is logged
                log.exception("process discovery failed; retrying next round")
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
