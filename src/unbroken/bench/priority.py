"""The load generator's CPU priority while it measures.

On a small machine the load generator shares the cores with what it measures. Sampled on
the 2-core VM during `unbroken demo` (/proc/PID/schedstat every 50 ms): in the rollout
window, while a replica's weights are read and a new engine starts, the two cores are
saturated and the load generator waited on the run queue 0.28-0.31 s per second (0.14 in
the steady window); its event loop woke up 30-124 ms late several times a window, and every
stream it was timing then looked that much slower. Clients of a real deployment run on
other machines. A real-time policy (SCHED_FIFO, the lowest priority) lets the load generator
run the moment it is runnable, so its clock measures the gateway and the engines, not its
own turn on a core; what the system under test does with the CPU that is left is still
measured. Both passes of the demo get the same policy. SCHED_RESET_ON_FORK keeps every
process it starts (gateway, engines, the L4 proxy) at the normal policy, and every thread
too (the flag acts on clone(), so the executor's threads that evict the weights from the
page cache or resolve names run normally): only the event loop's thread measures at FIFO.
The kernel's real-time throttling (`sched_rt_runtime_us`) bounds what it could take if it
ever spun. That loop also runs the pass's orchestration (unbroken's supervisor in the demo,
the standard deployment's rollout and Service updates): little CPU (spawns, health polls, the
rollout's steps), but it runs at the same policy, in both passes.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

__all__ = ["measuring_priority"]

_FIFO = getattr(os, "SCHED_FIFO", None)
_RESET = getattr(os, "SCHED_RESET_ON_FORK", 0)


@contextlib.contextmanager
def measuring_priority(enabled: bool = True) -> Iterator[str]:
    """SCHED_FIFO (priority 1) for the calling thread alone, back to the previous policy on
    exit. Yields what it got, for the report: "fifo", or "normal (why)"
    where the policy could not be set (not root, no RLIMIT_RTPRIO, not Linux)."""
    if not enabled:
        yield "normal (disabled)"
        return
    if _FIFO is None:
        yield "normal (no SCHED_FIFO on this platform)"
        return
    before = os.sched_getscheduler(0)
    param = os.sched_getparam(0)
    try:
        os.sched_setscheduler(0, _FIFO | _RESET, os.sched_param(1))
    except OSError as e:
        yield f"normal ({e.strerror.lower() if e.strerror else e}: needs root or RLIMIT_RTPRIO)"
        return
    try:
        yield "fifo"
    finally:
        with contextlib.suppress(OSError):
            os.sched_setscheduler(0, before, param)
