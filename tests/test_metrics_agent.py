"""The agent's exporter shape: series per endpoint (pid only on request), 23 log2 buckets from
1 µs to 4.3 s, and summed counters that never go backwards when a process exits.

The kernel side is replaced by a stand-in that returns the same per-(pid, function) records
the BPF map reader returns (loading BPF needs root; tests/test_agent.py runs the real tracer
and the real exporter)."""

from __future__ import annotations

import itertools
import math

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from unbroken.agent.cuda import CallStats
from unbroken.agent.discovery import ProcInfo
from unbroken.agent.maps import MAX_SLOTS
from unbroken.agent.service import BUCKETS, Agent, AgentConfig, _Collector, _cumulative


class StandInTracer:
    def __init__(self) -> None:
        self.stats: dict[tuple[int, str], CallStats] = {}

    def read(self) -> dict[tuple[int, str], CallStats]:
        return dict(self.stats)

    def close(self) -> None:
        pass


def _stats(count: int, slot: int) -> CallStats:
    slots = [0] * MAX_SLOTS
    slots[slot] = count
    return CallStats(count, count * 2**slot, slots)


def _scrape(reg: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(generate_latest(reg).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _agent(pid_label: bool) -> tuple[Agent, StandInTracer, CollectorRegistry]:
    tracer = StandInTracer()
    agent = Agent(AgentConfig(pid_label=pid_label), cuda=tracer)  # type: ignore[arg-type]
    for pid, ep in ((101, "primary-1"), (102, "primary-1"), (103, "fallback-1")):
        agent.procs[pid] = ProcInfo(pid=pid, endpoint=ep)
    reg = CollectorRegistry()
    reg.register(_Collector(agent))
    return agent, tracer, reg


def _calls(scrape: dict, **want: str) -> dict[tuple, float]:
    return {
        labels: v
        for (name, labels), v in scrape.items()
        if name == "unbroken_cuda_calls_total" and all((k, v2) in labels for k, v2 in want.items())
    }


def test_buckets_cover_1us_to_4s_log2() -> None:
    assert len(BUCKETS) == 23
    assert math.isclose(BUCKETS[0], 1.024e-6) and math.isclose(BUCKETS[-1], 2**32 / 1e9)
    assert all(math.isclose(b / a, 2) for a, b in itertools.pairwise(BUCKETS))
    slots = [0] * MAX_SLOTS
    slots[3], slots[10], slots[20], slots[35] = 1, 2, 3, 4  # 8 ns, 1 µs, 1 ms, 34 s
    cum = _cumulative(slots)
    assert cum[0] == 1 and cum[1] == 3 and cum[11] == 6 and cum[-1] == 6  # 34 s: only +Inf


def test_series_per_endpoint_without_pid_and_monotonic_after_exit() -> None:
    _, tracer, reg = _agent(pid_label=False)
    tracer.stats = {
        (101, "cudaLaunchKernel"): _stats(100, 12),
        (102, "cudaLaunchKernel"): _stats(50, 13),
        (103, "cudaLaunchKernel"): _stats(7, 12),
    }
    first = _scrape(reg)
    assert all("pid" not in dict(labels) for _name, labels in first)
    calls = _calls(first, function="cudaLaunchKernel")
    by_ep = {dict(k)["endpoint"]: v for k, v in calls.items()}
    assert by_ep == {"primary-1": 150, "fallback-1": 7}  # two processes of one endpoint summed
    buckets = [k for (name, k) in first if name == "unbroken_cuda_call_duration_seconds_bucket"]
    assert len(buckets) == 2 * 24  # 23 bounds and +Inf per series
    # Process 102 exits (its map entries are deleted); 101 keeps counting.
    tracer.stats = {
        (101, "cudaLaunchKernel"): _stats(120, 12),
        (103, "cudaLaunchKernel"): _stats(7, 12),
    }
    second = _calls(_scrape(reg), function="cudaLaunchKernel", endpoint="primary-1")
    assert list(second.values()) == [170.0]  # 120 + the exited process's 50: no reset


def test_pid_label_is_opt_in() -> None:
    _, tracer, reg = _agent(pid_label=True)
    tracer.stats = {
        (101, "cudaLaunchKernel"): _stats(100, 12),
        (102, "cudaLaunchKernel"): _stats(50, 13),
    }
    calls = _calls(_scrape(reg), function="cudaLaunchKernel")
    assert {dict(k)["pid"]: v for k, v in calls.items()} == {"101": 100, "102": 50}


def test_series_of_exited_processes_expire_after_a_grace() -> None:
    """Per-process series (`--pid-label`, or pods replaced on Kubernetes) of an exited process
    keep their last values for a grace, then go: cardinality stays bounded by the live
    processes plus the recently exited. A label set with a live member keeps its retired
    counts (the sum must not go backwards)."""
    agent, tracer, reg = _agent(pid_label=True)
    now = [1000.0]
    coll = next(iter(reg._collector_to_names))  # the one registered _Collector
    assert isinstance(coll, _Collector)
    coll.cuda_sums.clock = lambda: now[0]
    tracer.stats = {
        (101, "cudaLaunchKernel"): _stats(100, 12),
        (102, "cudaLaunchKernel"): _stats(50, 13),
    }
    _scrape(reg)
    tracer.stats = {(101, "cudaLaunchKernel"): _stats(120, 12)}  # 102 exits
    del agent.procs[102]
    now[0] += 60
    assert {dict(k)["pid"] for k in _calls(_scrape(reg))} == {"101", "102"}
    now[0] += 301
    pids = {dict(k)["pid"]: v for k, v in _calls(_scrape(reg)).items()}
    assert pids == {"101": 120}, pids
    assert coll.cuda_sums.retired == {}

    # Without the pid label: 102's counts stay in primary-1's sum while 101 lives.
    agent, tracer, reg = _agent(pid_label=False)
    coll = next(iter(reg._collector_to_names))
    coll.cuda_sums.clock = lambda: now[0]
    tracer.stats = {
        (101, "cudaLaunchKernel"): _stats(100, 12),
        (102, "cudaLaunchKernel"): _stats(50, 13),
    }
    _scrape(reg)
    tracer.stats = {(101, "cudaLaunchKernel"): _stats(120, 12)}
    now[0] += 1000
    _scrape(reg)
    now[0] += 1000
    assert list(_calls(_scrape(reg), endpoint="primary-1").values()) == [170.0]
