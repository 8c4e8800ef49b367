"""`unbroken agent --once`: attach, watch for a few seconds, print what was seen."""

from __future__ import annotations

import asyncio
import os

from rich.console import Console
from rich.table import Table

from unbroken.agent.service import PRESSED_S, Agent, AgentConfig

__all__ = ["run_once"]


def _fmt_ns(ns: float) -> str:
    for unit, div in (("s", 1e9), ("ms", 1e6), ("µs", 1e3)):
        if ns >= div:
            return f"{ns / div:.3g} {unit}"
    return f"{ns:.0f} ns"


async def _once(cfg: AgentConfig, seconds: float, console: Console) -> int:
    agent = Agent(cfg)
    agent.start()
    try:
        await agent.discover()
        t_end = asyncio.get_running_loop().time() + seconds
        while asyncio.get_running_loop().time() < t_end:
            await asyncio.sleep(
                min(cfg.interval, max(0.0, t_end - asyncio.get_running_loop().time()))
            )
            await agent.discover()
        if agent.ebpf_error:
            console.print(
                f"[yellow]eBPF unavailable:[/yellow] {agent.ebpf_error}; "
                "CUDA timing is off, TCP data comes from sock_diag sampling"
            )
        for rep in agent.libraries:
            console.print(
                f"[bold]{rep.path}[/bold]: attached "
                + ", ".join(f"{p.function} ({p.prologue})" for p in rep.attached)
                + (
                    ""
                    if not rep.skipped
                    else "; [red]skipped (single-step)[/red] "
                    + ", ".join(f"{p.function} ({p.prologue})" for p in rep.skipped)
                )
            )
        stats = agent.cuda.read() if agent.cuda else {}
        if stats:
            t = Table(title=f"CUDA calls over {seconds:g} s")
            for col in ("pid", "endpoint", "function", "calls", "mean", "histogram (log2 ns)"):
                t.add_column(col)
            for (pid, fn), st in sorted(stats.items()):
                top = max(st.slots) or 1
                used = [i for i, n in enumerate(st.slots) if n]
                bars = (
                    "\n".join(
                        f"{_fmt_ns(2**i):>8} {'█' * max(1, round(24 * st.slots[i] / top))} "
                        f"{st.slots[i]}"
                        for i in range(min(used), max(used) + 1)
                        if st.slots[i]
                    )
                    if used
                    else ""
                )
                t.add_row(
                    str(pid),
                    agent.info(pid).endpoint or agent.info(pid).comm,
                    fn,
                    str(st.count),
                    _fmt_ns(st.sum_ns / max(st.count, 1)),
                    bars,
                )
            console.print(t)
        elif agent.cuda is not None:
            console.print("no CUDA calls seen (no process maps a CUDA library, or none called)")
        tcp = {
            p: v
            for p, v in (agent.tcp.read() if agent.tcp else {}).items()
            if p in agent.procs or v.peak_ratio >= cfg.threshold or v.backpressure_s >= PRESSED_S
        }
        if tcp:
            t = Table(title=f"TCP send buffers ({agent.tcp.source if agent.tcp else ''})")
            for col in ("pid", "process", "fill now", "peak", "held back"):
                t.add_column(col)
            for pid, v in sorted(tcp.items()):
                info = agent.info(pid)
                t.add_row(
                    str(pid),
                    info.endpoint or info.comm,
                    f"{v.fill_ratio:.0%}",
                    f"{v.peak_ratio:.0%}",
                    f"{v.backpressure_s:.2f} s",
                )
            console.print(t)
        return 0
    finally:
        agent.close()


def run_once(cfg: AgentConfig, seconds: float, console: Console) -> int:
    if os.geteuid() != 0 and cfg.ebpf:
        console.print(
            "[yellow]note:[/yellow] not root; eBPF tracing needs root (CAP_BPF, "
            "CAP_PERFMON, CAP_SYS_ADMIN)"
        )
    return asyncio.run(_once(cfg, seconds, console))
