"""The load generator's real-time policy while it measures (bench/priority.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from unbroken.bench.priority import measuring_priority

ROOT = os.geteuid() == 0


def _policy() -> int:
    return os.sched_getscheduler(0) & ~getattr(os, "SCHED_RESET_ON_FORK", 0)


def _policy_of_new_thread() -> int:
    got: list[int] = []

    def body() -> None:
        got.append(_policy())

    t = threading.Thread(target=body)
    t.start()
    t.join()
    return got[0]


@pytest.mark.skipif(not ROOT, reason="SCHED_FIFO needs root or RLIMIT_RTPRIO (CI runs as root)")
def test_fifo_for_the_measuring_thread_alone_and_back_after() -> None:
    assert _policy() == os.SCHED_OTHER
    with measuring_priority() as got:
        assert got == "fifo"
        assert _policy() == os.SCHED_FIFO
        assert os.sched_getscheduler(0) & os.SCHED_RESET_ON_FORK
        assert os.sched_getparam(0).sched_priority == 1
        # SCHED_RESET_ON_FORK acts on clone(): the executor's threads (evicting the weights,
        # resolving names) and what it starts (gateway, engines, proxy) run normally.
        assert _policy_of_new_thread() == os.SCHED_OTHER
        child = subprocess.run(
            [sys.executable, "-c", "import os; print(os.sched_getscheduler(0))"],
            capture_output=True,
            text=True,
            check=True,
        )
        assert int(child.stdout) == os.SCHED_OTHER
    assert _policy() == os.SCHED_OTHER


def test_disabled_or_not_permitted_says_why_and_changes_nothing() -> None:
    with measuring_priority(enabled=False) as got:
        assert got == "normal (disabled)"
        assert _policy() == os.SCHED_OTHER
    if ROOT:
        return
    with measuring_priority() as got:  # an unprivileged user without RLIMIT_RTPRIO
        assert got.startswith("normal (") and "root" in got, got
        assert _policy() == os.SCHED_OTHER
