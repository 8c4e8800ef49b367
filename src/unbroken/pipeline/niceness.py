"""Lowering a starting replica's CPU priority, and raising it again once it serves.

A replica runs in its own session (the supervisor starts it with `start_new_session`, so
that a stop reaches every process it forked). Where the kernel groups sessions for the
scheduler (CONFIG_SCHED_AUTOGROUP, `kernel.sched_autogroup_enabled = 1`, the default of
most distributions), a session competes with every other session as one unit, and a nice
value set on its processes only orders them *inside* that unit. Measured on the 2-core VM
(kernel 6.18, four nice-0 busy loops in their own sessions beside a fifth): niced to 10 with
setpriority(), the fifth still took 1.22 s of CPU in 3 s, the same as the others (1.16-1.20);
with its autogroup's nice also 10 (`/proc/PID/autogroup`), 0.15 s. So both are set: the
process group's nice (what a kernel without autogroups uses, and what orders the processes
inside the session) and, where the session leader has one, its autogroup's.
"""

from __future__ import annotations

import logging
import os
import resource
from pathlib import Path

__all__ = ["autogroups_enabled", "may_renice", "set_session_nice"]

log = logging.getLogger("unbroken.pipeline")

AUTOGROUP_SWITCH = Path("/proc/sys/kernel/sched_autogroup_enabled")


def may_renice() -> bool:
    """Whether a process we lower can be brought back to nice 0: root (CAP_SYS_NICE) or an
    RLIMIT_NICE of 20 (its ceiling is 20 - rlim). Elsewhere a lowered replica would serve
    at the lower priority for good, so it is not lowered at all."""
    if os.geteuid() == 0:
        return True
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    return soft == resource.RLIM_INFINITY or soft >= 20


def autogroups_enabled() -> bool:
    """Whether the kernel schedules sessions as autogroups (read each time: a sysctl)."""
    try:
        return AUTOGROUP_SWITCH.read_text().strip() == "1"
    except OSError:  # no CONFIG_SCHED_AUTOGROUP: nice values are all there is
        return False


def set_session_nice(leader: int, nice: int) -> None:
    """Set the nice value of the process group `leader` leads and, where sessions are
    scheduled as autogroups, of the session's autogroup. OSError from the group's (the
    process is gone, not permitted) is the caller's; the autogroup's is logged."""
    os.setpriority(os.PRIO_PGRP, leader, nice)
    if not autogroups_enabled():
        return
    try:
        # Only a session leader's autogroup is its own; another process's is its parent's
        # session's (the supervisor's, the user's shell's), never ours to change.
        if os.getsid(leader) == leader:
            Path(f"/proc/{leader}/autogroup").write_text(f"{nice}\n")
    except OSError as e:
        log.warning(
            "autogroup nice %d for pid %d: %s (its nice value alone does not lower "
            "it against other sessions)",
            nice,
            leader,
            e.strerror or e,
        )
