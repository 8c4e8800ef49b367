"""The demo's two deployments and what they stand on: the block-I/O throttle that plays the
seed's network storage, the standard deployment's L4 round-robin proxy, and the whole demo
scaled down (both passes, the seed table)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from helpers import MODEL, Proc, engine, metric, stream, stream_text, wait_for
from unbroken.bench.throttle import PREFIX, IoThrottle, ThrottleUnavailable, block_device
from unbroken.engine.textmodel import expected_completion
from unbroken.prewarm import evict
from unbroken.wire.http import free_port

# -- throttle -----------------------------------------------------------------------------------


def test_block_device_is_a_whole_disk(tmp_path: Path) -> None:
    f = tmp_path / "x"
    f.write_bytes(b"x")
    try:
        dev = block_device(f)
    except ThrottleUnavailable as e:
        assert "not a block device" in str(e)
        return
    major, minor = dev.split(":")
    sys_dev = Path("/sys/dev/block") / dev
    assert major.isdigit() and minor.isdigit() and sys_dev.exists()
    assert not (sys_dev / "partition").exists()  # the kernel limits whole disks only


def test_throttle_says_why_when_not_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ThrottleUnavailable, match="not root"):
        IoThrottle.create(tmp_path)


def _timed_read(path: Path, throttle: IoThrottle | None) -> float:
    """Read `path` in a child process (inside the throttle's cgroup when given)."""
    code = (
        "import sys, time, os\n"
        "t = time.monotonic()\n"
        "with open(sys.argv[1], 'rb', buffering=0) as f:\n"
        "    while f.read(1 << 20): pass\n"
        "print(time.monotonic() - t)\n"
    )
    argv = [sys.executable, "-c", code, str(path)]
    if throttle is not None:
        argv = ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(throttle.path), *argv]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True)
    return float(out.stdout.strip())


@pytest.mark.skipif(os.geteuid() != 0, reason="cgroup block-I/O limits need root")
def test_throttle_caps_cold_reads_and_spares_the_page_cache(tmp_path: Path) -> None:
    """40 MB at a 40 MB/s cap take about a second when read from the disk; the same file in
    the page cache is read at memory speed through the same cap (what pre-warming buys)."""
    f = tmp_path / "weights.bin"
    f.write_bytes(os.urandom(40 * 2**20))
    try:
        th = IoThrottle.create(f, read_bps=40_000_000, name=f"unbroken-test-{os.getpid()}")
    except ThrottleUnavailable as e:
        pytest.skip(f"root, but no block-I/O controller to use: {e}")
    try:
        assert th.read_bytes() == 0
        evict(f)
        cold = _timed_read(f, th)
        assert cold > 0.6, f"40 MB read in {cold:.2f} s through a 40 MB/s cap"
        assert th.read_bytes() >= 30 * 2**20
        warm = _timed_read(f, th)  # now cached
        assert warm < cold / 4, (cold, warm)
        evict(f)
        free = _timed_read(f, None)
        assert free < cold, (cold, free)
        assert "40 MB/s" in th.describe()
    finally:
        th.remove()
    assert not th.path.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="cgroup block-I/O limits need root")
def test_a_killed_demos_throttle_cgroup_is_swept_by_the_next(tmp_path: Path) -> None:
    """A demo killed before its cleanup left `unbroken-io-PID` behind (two on this machine
    after interrupted suites); the next demo's throttle removes those of dead demos and leaves
    a live one's alone."""
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x" * 4096)
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()  # a pid that was a demo's a moment ago
    try:
        live = IoThrottle.create(f, name=f"{PREFIX}{os.getppid()}")
        dead = IoThrottle.create(f, name=f"{PREFIX}{p.pid}")  # it sweeps before it is made
    except ThrottleUnavailable as e:
        pytest.skip(f"root, but no block-I/O controller to use: {e}")
    th = None
    try:
        assert dead.path.exists() and live.path.exists()
        th = IoThrottle.create(f, name=f"unbroken-test-{os.getpid()}")
        assert not dead.path.exists()
        assert live.path.exists()
    finally:
        for t in (dead, live, th):
            if t is not None and t.path.exists():
                t.remove()


# -- the standard deployment's proxy ---------------------------------------------------------


class _Proxy:
    def __init__(self, tmp: Path, backends: list[str]) -> None:
        self.file = tmp / "endpoints.json"
        self.ack = tmp / "endpoints.json.ack"
        self.gen = 0
        self.write(backends)
        self.port = free_port()
        self.proc = Proc(
            [
                sys.executable,
                "-m",
                "unbroken.bench.rrproxy",
                "--listen",
                f"127.0.0.1:{self.port}",
                "--backends",
                str(self.file),
            ],
            self.port,
            tmp / "rrproxy.log",
        )
        self.proc.start()

    def write(self, backends: list[str]) -> None:
        self.gen += 1
        self.file.write_text(json.dumps({"backends": backends, "generation": self.gen}))

    def reload(self, backends: list[str]) -> None:
        self.write(backends)
        self.proc.signal(signal.SIGHUP)
        wait_for(lambda: self.ack.read_text() == str(self.gen), what="proxy reload")


def test_rrproxy_relays_sse_round_robin_and_follows_endpoint_updates(tmp_path: Path) -> None:
    a = engine(tmp_path, name="a", fast=False)
    b = engine(tmp_path, name="b", fast=False)
    proxy = _Proxy(tmp_path, [a.url, b.url])
    try:
        before = {p.url: metric(p.url, "vllm:request_success_total") for p in (a, b)}
        body = {"model": MODEL, "prompt": "Round robin please", "max_tokens": 24}
        for _ in range(4):  # a new connection each time: two for each engine
            t0 = time.monotonic()
            events, r = stream(proxy.proc.url, "/v1/completions", {**body, "temperature": 0})
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            assert events[-1] == "[DONE]"
            assert stream_text(events, chat=False) == expected_completion(body["prompt"], 24).text
            assert time.monotonic() - t0 < 30
        after = {p.url: metric(p.url, "vllm:request_success_total") for p in (a, b)}
        assert {u: after[u] - before[u] for u in after} == {a.url: 2, b.url: 2}

        # tokens arrive as the engine makes them, not when the stream ends
        with httpx.stream(
            "POST",
            proxy.proc.url + "/v1/completions",
            json={**body, "max_tokens": 40, "stream": True},
            timeout=30,
        ) as r:
            t0 = time.monotonic()
            first = None
            for chunk in r.iter_raw():
                if first is None and b'"text"' in chunk:
                    first = time.monotonic() - t0
            total = time.monotonic() - t0
        assert first is not None and first < total / 2, (first, total)

        # an Endpoints update: b leaves the Service, new connections all go to a
        proxy.reload([a.url])
        base = metric(a.url, "vllm:request_success_total")
        for _ in range(3):
            events, r = stream(proxy.proc.url, "/v1/completions", {**body, "max_tokens": 4})
            assert r.status_code == 200 and events[-1] == "[DONE]"
        assert metric(a.url, "vllm:request_success_total") - base == 3
    finally:
        for p in (proxy.proc, a, b):
            p.stop()


def test_rrproxy_passes_a_backend_failure_on_to_the_client(tmp_path: Path) -> None:
    """The baseline must be honest in both directions: an engine killed mid-stream breaks the
    client's stream (no retry, no migration), and with no backend the connection is refused."""
    a = engine(tmp_path, name="victim", fast=False)
    proxy = _Proxy(tmp_path, [a.url])
    try:
        got = []
        with httpx.stream(
            "POST",
            proxy.proc.url + "/v1/completions",
            json={"model": MODEL, "prompt": "x", "max_tokens": 400, "stream": True},
            timeout=30,
        ) as r:
            assert r.status_code == 200
            with pytest.raises(httpx.HTTPError):
                for chunk in r.iter_raw():
                    got.append(chunk)
                    if len(got) == 3:
                        a.signal(signal.SIGKILL)
        assert b"[DONE]" not in b"".join(got)
        proxy.reload([])
        with pytest.raises(httpx.HTTPError):
            httpx.get(proxy.proc.url + "/health", timeout=5)
    finally:
        proxy.proc.stop()
        a.stop()


# -- the whole demo, scaled down -------------------------------------------------------------


def test_demo_end_to_end(tmp_path: Path) -> None:
    """Both passes (standard deployment, unbroken) with 40 users and short windows: same
    phases, the seed table's rows in results.json, unbroken's zero dropped and corrupted
    streams, and the standard deployment's rollout breaking streams (SIGTERM aborts them).
    With ~100 requests a window, p99.9 TTFT is the single worst request, so the ratio target
    is loosened to 3x here; the 1.5x target is for 200 users. The verdict is not asserted
    (PASS or FAIL, said consistently), so this runs beside other tests: what it asserts,
    zero dropped and corrupted streams, holds on a loaded machine too (it ran `serial`, the
    machine to itself, until 2026-12-07: 85 s of the suite's 25 minutes with one worker
    idle). Beside them it runs without what would reach into their processes: the eBPF
    agent (`--no-agent`; as root its uprobes attach to every engine's CUDA library on the
    machine: `unbroken up` with the agent is test_controller's agent loop, `serial`) and the
    SCHED_FIFO load generator (`--no-realtime-loadgen`; tests/test_bench_priority.py)."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "unbroken",
            "demo",
            "--users",
            "40",
            "--steady",
            "6",
            "--contention",
            "6",
            "--recovery",
            "5",
            "--deadline",
            "2",
            "--settle",  # the rollout's end to the kill, and the replacement to the window's end
            "2",
            "--after-kill",
            "2",
            "--weights-size",
            "64MiB",
            "--max-ttft-ratio",
            "3",
            "--no-agent",
            "--no-realtime-loadgen",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=420,
    )
    out = r.stdout + r.stderr
    assert r.returncode in (0, 1), out
    assert ("PASS" in out) == (r.returncode == 0) and "seed's results table" in out
    data = json.loads((tmp_path / "results.json").read_text())
    rows = {row["metric"]: row for row in data["seed_table"]}
    need = {"cold_start_s", "p999_ttft_ms_under_load", "dropped_streams_rollout", "stall_spikes"}
    assert need <= set(rows), rows
    for row in data["seed_table"]:
        assert set(row) >= {"metric", "standard", "unbroken", "unit"}
    assert data["config"]["passes"] == ["standard", "unbroken"]
    phases = data["config"]["phases"]
    assert (phases["settle_s"], phases["after_kill_s"], phases["ramp_s"]) == (2, 2, 3), phases
    std = json.loads((tmp_path / "standard" / "results.json").read_text())
    for run in (data, std):
        kinds = {e["event"] for e in run["events"]}
        assert {
            "contention_start",
            "contention_end",
            "rollout_start",
            "rollout_end",
            "replica_killed",
            "replica_replaced",
        } <= kinds, kinds
        assert len(run["records"]) > 100
    # unbroken's guarantees hold at any scale
    checks = {c["metric"]: c for c in data["checks"]}
    for name in ("dropped_streams_rollout", "dropped_streams_chaos", "corrupted_streams"):
        assert checks[name]["ok"], checks[name]
        assert rows[name]["unbroken"] == 0
    assert data["windows"]["rollout"]["open"]["streams"] > 0
    assert all(isinstance(rows[m]["unbroken"], int | float) for m in need)
    # the standard deployment is measured, not assumed: SIGTERM with in-flight streams
    assert rows["dropped_streams_rollout"]["standard"] > 0
    assert rows["cold_start_s"]["standard"] > 0 and rows["cold_start_s"]["unbroken"] > 0
    spans = {s["name"] for s in data["spans"]}
    assert {"contention", "rollout"} <= spans
    if data["config"]["storage"].startswith("storage: reads"):  # root with a blkio controller
        # The weight readers, and only they, were put behind the cap: the standard
        # deployment's cold starts and unbroken's pre-warms read 64 MiB each through it.
        assert data["config"]["storage_throttled_read_bytes"] >= 3 * 64 * 2**20


# -- the table's arithmetic ----------------------------------------------------------------------


def test_stall_spikes_count_long_gaps_ending_in_the_window() -> None:
    from unbroken.bench.demo import stall_spikes
    from unbroken.bench.load import Record

    r = Record(user=0, kind="chat", priority="standard", slow=False, start=10.0, max_tokens=8)
    r.ttft = 0.1  # first token at 10.1
    r.gaps = [0.05, 0.2, 0.05, 0.3, 0.16]  # tokens at 10.15, 10.35, 10.4, 10.7, 10.86
    assert stall_spikes([r], 10.0, 11.0, 0.15) == 3
    assert stall_spikes([r], 10.0, 10.5, 0.15) == 1  # the 0.3 s gap ends at 10.7
    assert stall_spikes([r], 10.0, 11.0, 0.25) == 1
    r.ttft = None  # no token at all: nothing to count
    assert stall_spikes([r], 0.0, 100.0, 0.0) == 0


def test_critical_tokens_at_reduced_precision_are_counted_from_either_header() -> None:
    """The engine's own X-Unbroken-Profile (through an L4 proxy) wins; else the gateway's
    endpoint name (POOL-N) and the pool's precision; non-critical work does not count."""
    from types import SimpleNamespace as R

    from unbroken.bench.demo import critical_reduced_pct

    recs = [
        R(priority="critical", tokens=30, profile="fp16", endpoint=None),
        R(priority="critical", tokens=10, profile="fp8", endpoint=None),
        R(priority="critical", tokens=40, profile=None, endpoint="primary-2"),
        R(priority="critical", tokens=20, profile=None, endpoint="fallback-1"),
        R(priority="standard", tokens=500, profile="fp8", endpoint="fallback-1"),
        R(priority="critical", tokens=0, profile="fp8", endpoint=None),
    ]
    assert critical_reduced_pct(recs, {"primary": "fp16", "fallback": "fp8"}) == 30.0
    assert critical_reduced_pct(recs[4:], {}) is None


def test_no_agent_leaves_the_agent_out_of_both_passes() -> None:
    """`unbroken demo --no-agent`: the pipelines it starts have no node agent, whoever runs
    it (as root the default spec's "auto" would start one)."""
    from unbroken.bench.demo import _spec
    from unbroken.pipeline.companions import agent_wanted

    assert _spec("64MiB").agent.enabled == "auto"
    off = _spec("64MiB", agent=False)
    assert off.agent.enabled is False
    wanted, why = agent_wanted(off)
    assert not wanted and why.startswith("disabled"), why
