from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from helpers import UPS, Proc, engine, gateway


@pytest.fixture(scope="session", autouse=True)
def _isolated_dirs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Tests never touch the user's state; the CUDA stub cache is shared across the run."""
    base = tmp_path_factory.mktemp("unbroken")
    os.environ["UNBROKEN_STATE_DIR"] = str(base / "state")
    cache = os.environ.setdefault("UNBROKEN_CACHE_DIR", str(base / "cache"))
    if os.environ.get("PYTEST_XDIST_WORKER") and cache == str(base / "cache"):
        # One CUDA stub for the run's workers (its build is atomic): an agent attaches its
        # uprobes once per library file and detaches each in ~0.1 s, so a stub per worker
        # made every agent's exit take twice as long (test_exporter_and_clean_exit's 20 s).
        shared = tmp_path_factory.getbasetemp().parent / "cuda"
        shared.mkdir(exist_ok=True)
        Path(cache).mkdir(parents=True, exist_ok=True)
        (Path(cache) / "cuda").symlink_to(shared, target_is_directory=True)
    yield
    for up in UPS:  # a pipeline's data plane outlives a killed supervisor: leave none behind
        up.kill_orphans()


@pytest.fixture(scope="module")
def logdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def shared_engine(logdir: Path) -> Iterator[Proc]:
    p = engine(logdir, name="shared")
    yield p
    p.stop()


@pytest.fixture(scope="module")
def shared_gateway(logdir: Path) -> Iterator[tuple[Proc, Proc, Proc]]:
    """Two engines behind one gateway."""
    a = engine(logdir, name="a")
    b = engine(logdir, name="b")
    g = gateway(logdir, a.url, b.url)
    yield g, a, b
    for p in (g, a, b):
        p.stop()


# -- running in parallel (pytest-xdist, `-n` in pyproject's addopts) ---------------------------
#
# Most of this suite waits on processes, sockets and timers, so its files run on two workers
# (`--dist loadfile`: a file's module fixtures, its engines and pipelines, are started once).
# A test marked `serial` runs with no other test of the run beside it: the real-vLLM servers
# (pinned one per core) load the whole machine, and an eBPF agent attaches to (and on exit
# detaches from) the CUDA library of every engine on it, the other worker's included; beside
# another test each is slower, and flakier.

# Files whose tests run alone (node ids start with these): files this conftest's owners may
# not mark themselves; the others carry `pytestmark = pytest.mark.serial`.
SERIAL_FILES: tuple[str, ...] = ()

# The files that take longest, first (the workers take files as they free up, so the last
# file a worker takes should be a short one). From a serial run's `--durations=0` of
# 2026-12-03 on a loaded 2-core machine (seconds: 251, 196, 161, 142, 124, 119, 109, 90...).
# (A list by 2026-12-07's durations put test_rollout beside test_gateway_reload and other
# pipelines: a run 30 % slower, with load-bound failures; this order's pairs are proven.)
SLOW_FIRST: tuple[str, ...] = tuple(
    f"tests/{name}.py"
    for name in (
        "test_controller",
        "test_demo",
        "test_hardening_pipeline",
        "test_rollout",
        "test_tenants",
        "test_reliability_supervisor",
        "test_pipeline",
        "test_malformed",
        "test_gateway_handover",
        "test_k8s_discovery",
        "test_migration",
        "test_gateway_reload",
        "test_up_reload",
        "test_gateway",
        "test_multimodel",
        "test_hardening",
        "test_reliability_gwmain",
        "test_gateway_workers",
        "test_bench",
        "test_tenants_redis",
        # Last in collection order and ~60 s: a worker that took it last held it through the
        # whole real-vLLM tier (its next test waiting on the tier's lock), 37 s after it.
        "test_supervisor_day2",
    )
)


# The real-vLLM tier: its files run last, so that on a fresh machine its install, started in
# the background when a run collects it (`pytest_collection_finish`), overlaps the rest of
# the run instead of one `serial` test's setup holding the whole machine for ~1.5 minutes.
VLLM_TIER = "tests/vllm/"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files with serial tests first (nothing runs beside those), then the slowest files, then
    the rest in collection order, the real-vLLM tier last; each file's tests stay together
    and in their order, except that a file's serial tests come before its others: the run's
    serial part is then over within its first minutes, instead of a serial test late in a
    file (test_controller's eBPF agent tests) holding the other worker idle while it waits
    for that worker's long test to end, and then for itself."""
    for item in items:
        if item.nodeid.startswith(SERIAL_FILES):
            item.add_marker(pytest.mark.serial)
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    first: dict[str, int] = {}
    serial: set[str] = set()  # files with a serial test: kept whole (module fixtures start once)
    for i, item in enumerate(items):
        f = item.nodeid.split("::", 1)[0]
        first.setdefault(f, i)
        if item.get_closest_marker("serial") is not None:
            serial.add(f)

    def key(item: pytest.Item) -> tuple[int, int, int, int]:
        f = item.nodeid.split("::", 1)[0]
        group = 2 if f.startswith(VLLM_TIER) else 0 if f in serial else 1
        alone = 0 if group == 0 and item.get_closest_marker("serial") is not None else 1
        return (group, rank.get(f, len(rank)), first[f], alone)

    items.sort(key=key)  # stable: a file's tests keep their order, its serial ones first


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start preparing the real-vLLM tier (tests/vllm/prepare.py: install, models) in the
    background when this run has its tests (it returns at once when the cache has both);
    once per run (the first xdist worker, or the only process)."""
    if os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0":
        return
    if not any(item.nodeid.startswith(VLLM_TIER) for item in session.items):
        return
    subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve().parent / "vllm" / "prepare.py")],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,  # it writes its own log
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # outlives an interrupted run: the cache is finished
    )


class RunLock:
    """A readers-writer lock over the workers of one run (flock(2) on two files in the run's
    base temporary directory, released by the kernel if a worker dies). A test takes it
    shared, a `serial` test exclusive. Writers come first: one waiting holds the gate, so no
    new test starts and it waits only for those already running."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self._gate = open(directory / "serial.gate", "a+")  # held for the run
        self._main = open(directory / "serial.lock", "a+")
        self.held: str | None = None

    def take(self, exclusive: bool) -> None:
        want = "exclusive" if exclusive else "shared"
        if self.held == want:
            return
        self.release()
        fcntl.flock(self._gate, fcntl.LOCK_EX)
        fcntl.flock(self._main, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        if not exclusive:
            fcntl.flock(self._gate, fcntl.LOCK_UN)
        self.held = want

    def release(self) -> None:
        if self.held is None:
            return
        fcntl.flock(self._main, fcntl.LOCK_UN)
        if self.held == "exclusive":
            fcntl.flock(self._gate, fcntl.LOCK_UN)
        self.held = None


_RUN_LOCK: RunLock | None = None


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, object, object]:
    """Under xdist, run a test (setup, call and teardown, before pytest-timeout's timer starts)
    holding the run's lock: exclusive for a `serial` test, kept to the end of its file's
    serial tests so that its module fixtures (vLLM servers) never share the machine either."""
    global _RUN_LOCK
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return (yield)
    if _RUN_LOCK is None:
        _RUN_LOCK = RunLock(Path(str(item.config.option.basetemp)).parent)
    serial = item.get_closest_marker("serial") is not None
    asked = time.time()
    _RUN_LOCK.take(exclusive=serial)
    got = time.time()
    try:
        return (yield)
    finally:
        _timeline(item, asked, got)
        keep = (
            serial
            and nextitem is not None
            and nextitem.get_closest_marker("serial") is not None
            and nextitem.nodeid.split("::", 1)[0] == item.nodeid.split("::", 1)[0]
        )
        if not keep:
            _RUN_LOCK.release()


def _timeline(item: pytest.Item, asked: float, got: float) -> None:
    """With UNBROKEN_TEST_TIMELINE=FILE, a line per test: worker, when it asked for the run's
    lock, got it, and ended (epoch seconds), node id: where a run's workers waited or idled
    (the suite is held under 25 minutes; --durations shows neither)."""
    path = os.environ.get("UNBROKEN_TEST_TIMELINE")
    if path:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "-")
        with open(path, "a") as f:
            f.write(f"{worker} {asked:.2f} {got:.2f} {time.time():.2f} {item.nodeid}\n")


_RERUNS: list[pytest.TestReport] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.outcome == "rerun":
        _RERUNS.append(report)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """What a test that passed only on its rerun (pyproject's `--reruns 1`) failed with the
    first time, so that a flaky test is seen, not just counted."""
    if not _RERUNS:
        return
    terminalreporter.section("first failures of rerun tests")
    for r in _RERUNS:
        lines = str(r.longrepr).splitlines()
        errors = [ln for ln in lines if ln.startswith("E ")][:6]
        terminalreporter.write_line(f"{r.nodeid} ({r.when}, {r.duration:.1f} s):")
        for ln in errors or lines[-3:]:
            terminalreporter.write_line("    " + ln)


@pytest.fixture
def two_engines(tmp_path: Path) -> Iterator[list[Proc]]:
    """Two simulated engines (fast steps) of the test's own, stopped after it."""
    engs = [engine(tmp_path, name=f"e{i}") for i in range(2)]
    yield engs
    for e in engs:
        e.stop()
