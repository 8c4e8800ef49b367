"""`unbroken bench`: a load run with an optional scenario against a pipeline, then the report."""

from __future__ import annotations

import asyncio
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from unbroken.bench.control import PipelineControl, Sampler
from unbroken.bench.load import LoadConfig, LoadRun, Record
from unbroken.bench.report import fmt_ms, write_report
from unbroken.bench.stats import summarize

__all__ = ["live_progress", "make_window", "markdown_table", "run_bench", "window_counts"]


def window_counts(records: list[Record], start: float, end: float) -> dict[str, int]:
    """Outcomes of the streams that were open at some point in [start, end)."""
    out: dict[str, int] = {}
    for r in records:
        if r.start < end and (r.end or math.inf) > start and r.status == 200:
            out[r.outcome] = out.get(r.outcome, 0) + 1
    return out


def markdown_table(windows: dict[str, dict[str, Any]], records: list[Record]) -> str:
    rows = [
        "| window | requests | ok | dropped | corrupted | rejected | TTFT p50 | TTFT p99 | "
        "TTFT p99.9 | ITL p50 | ITL p99 | TPOT p50 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, w in windows.items():
        s = w["summary"]
        o = s["outcomes"]
        rows.append(
            f"| {name} ({w['start']:.0f}-{w['end']:.0f} s) | {s['requests']} | {o.get('ok', 0)} | "
            f"{w['open']['dropped']} | {w['open']['corrupted']} | {o.get('rejected', 0)} | "
            f"{fmt_ms(s['ttft']['p50'])} | {fmt_ms(s['ttft']['p99'])} | "
            f"{fmt_ms(s['ttft']['p99.9'])} | {fmt_ms(s['itl']['p50'])} | "
            f"{fmt_ms(s['itl']['p99'])} | {fmt_ms(s['tpot']['p50'])} |"
        )
    rows.append("")
    rows.append(
        "Requests and latencies: requests started in the window. Dropped and corrupted: "
        "streams open at any time in the window."
    )
    return "\n".join(rows)


def make_window(records: list[Record], start: float, end: float) -> dict[str, Any]:
    open_ = window_counts(records, start, end)
    return {
        "start": start,
        "end": end,
        "summary": summarize(records, start, end),
        "open": {
            "dropped": open_.get("dropped", 0),
            "corrupted": open_.get("corrupted", 0),
            "streams": sum(open_.values()),
        },
    }


def live_progress(console: Console) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[stats]}"),
        console=console,
        transient=False,
    )


async def run_bench(
    cfg: LoadConfig,
    *,
    scenario: str,
    at: float,
    pool: str,
    deadline_s: float,
    out: Path,
    control: PipelineControl | None,
    sampler: Sampler | None,
    console: Console,
) -> dict[str, Any]:
    load = LoadRun(cfg)
    scenario_window: tuple[float, float] | None = None
    with live_progress(console) as prog:
        task_id = prog.add_task(f"bench {scenario}", total=cfg.duration, stats="")
        runner = asyncio.create_task(load.run())
        await asyncio.sleep(0)  # let the run set its t0
        if sampler is not None:
            sampler.start(load.t0)

        async def action() -> None:
            nonlocal scenario_window
            if scenario == "steady" or control is None:
                return
            await asyncio.sleep(at)
            t0 = load.now()
            if scenario == "rollout":
                load.mark("rollout_start", pool=pool)
                summary = await control.rollout(pool, {}, deadline_s=deadline_s)
                load.mark("rollout_end", ok=summary.get("ok"), seconds=summary.get("seconds"))
            elif scenario == "chaos":
                victim = await control.kill(pool)
                load.mark("replica_killed", replica=victim["name"], pid=victim["pid"])
                by = await control.wait_replaced(victim["name"])
                load.mark("replica_replaced", replica=victim["name"], by=by)
            scenario_window = (t0, load.now() + 5.0)

        act = asyncio.create_task(action())
        while not runner.done():
            await asyncio.sleep(0.5)
            prog.update(
                task_id,
                completed=min(cfg.duration, load.now()),
                stats=load.status(),
            )
        await act
    if sampler is not None:
        await sampler.stop()
    records = load.records
    end = max((r.end or r.start) for r in records) if records else 0.0
    windows = {"whole run": make_window(records, 0.0, end + 1)}
    if scenario_window is not None:
        windows["before " + scenario] = make_window(records, min(10.0, at / 2), scenario_window[0])
        windows[scenario] = make_window(records, *scenario_window)
    md = markdown_table(windows, records)
    report = write_report(
        out,
        title=f"unbroken bench: {scenario}",
        config=asdict(cfg),
        records=records,
        events=load.events,
        samples=sampler.samples if sampler else [],
        windows=windows,
        markdown=md,
    )
    console.print(md)
    console.print(f"report: {report}")
    return {"windows": windows, "report": str(report), "events": load.events}
