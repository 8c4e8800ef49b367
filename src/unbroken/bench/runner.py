"""`unbroken bench`: a load run with an optional scenario against a pipeline, then the report."""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from unbroken.bench.control import PipelineControl, Sampler
from unbroken.bench.load import LoadConfig, LoadRun, Record, base_url, error_key
from unbroken.bench.report import Marker, Span, fmt_ms, results_json, run_metadata, write_report
from unbroken.bench.stats import summarize
from unbroken.bench.workloads import EngineWatch, describe

__all__ = [
    "error_counts",
    "live_progress",
    "make_window",
    "markdown_table",
    "run_bench",
    "verdict",
    "window_counts",
]

MAX_ERROR_RATE = 0.01  # default share of requests that may end in an error before exit 1
SCENARIO_MARGIN_S = 5.0  # the scenario's window (and the load) runs this long past its end
# How long past --duration the load waits for a scenario still running: past every bound the
# scenarios have (a rollout's 600 s read timeout, a command's 600 s, a kill's 60 s wait).
MAX_EXTENSION_S = 900.0


def error_counts(
    records: list[Record], start: float = 0.0, end: float = math.inf
) -> dict[str, int]:
    """Errors of the requests started in [start, end), by status code (or exception)."""
    c = Counter(error_key(r) for r in records if r.outcome == "error" and start <= r.start < end)
    return dict(c.most_common())


def fmt_errors(errors: dict[str, int]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in errors.items()) or "0"


def _follow(control: PipelineControl | None) -> Callable[[], Awaitable[list[str]]] | None:
    """The pipeline's engines now, for `EngineWatch` to follow through a scenario."""
    if control is None:
        return None

    async def engines() -> list[str]:
        st = await control.status()
        return [str(r["url"]) for r in st.get("replicas", []) if r.get("url")]

    return engines


async def _pipeline_line(control: PipelineControl) -> str:
    """The pools of the pipeline under test, as its supervisor reports them now."""
    try:
        st = await control.status()
    except Exception as e:  # the report is still worth writing without this line
        return f"unknown ({type(e).__name__})"
    by_pool: dict[str, list[str]] = {}
    for r in st.get("replicas", []):
        by_pool.setdefault(r.get("pool", "?"), []).append(r.get("precision") or "?")
    return ", ".join(
        f"{pool}: {len(ps)} x {'/'.join(sorted(set(ps)))}" for pool, ps in sorted(by_pool.items())
    )


def _outcome_line(records: list[Record]) -> str:
    o = Counter(r.outcome for r in records)
    parts = ", ".join(
        f"{o[k]} {k}"
        for k in ("ok", "dropped", "corrupted", "rejected", "error")
        if o[k] or k == "ok"
    )
    return f"{len(records)} requests: {parts}"


def verdict(records: list[Record], max_error_rate: float = MAX_ERROR_RATE) -> list[str]:
    """Why the run failed (empty when it passed): no request succeeded, errors above
    `max_error_rate` of the requests, or any dropped or corrupted stream."""
    n = len(records)
    outcomes = Counter(r.outcome for r in records)
    errors = error_counts(records)
    why = []
    if outcomes["ok"] == 0:
        detail = f"; errors: {fmt_errors(errors)}" if errors else ""
        why.append(f"no request succeeded ({n} sent{detail})")
    elif n and outcomes["error"] / n > max_error_rate:
        why.append(
            f"{outcomes['error']} of {n} requests ended in an error "
            f"({outcomes['error'] / n:.1%} > {max_error_rate:.1%}): {fmt_errors(errors)}"
        )
    for bad in ("dropped", "corrupted"):
        if outcomes[bad]:
            why.append(f"{outcomes[bad]} {bad} stream(s)")
    return why


def window_counts(records: list[Record], start: float, end: float) -> dict[str, int]:
    """Outcomes of the streams that were open at some point in [start, end)."""
    out: dict[str, int] = {}
    for r in records:
        if r.start < end and (r.end or math.inf) > start and r.status == 200:
            out[r.outcome] = out.get(r.outcome, 0) + 1
    return out


def markdown_table(windows: dict[str, dict[str, Any]], records: list[Record]) -> str:
    rows = [
        "| window | requests | ok | dropped | corrupted | rejected | errors | TTFT p50 | "
        "TTFT p99 | TTFT p99.9 | ITL p50 | ITL p99 | TPOT p50 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, w in windows.items():
        s = w["summary"]
        o = s["outcomes"]
        rows.append(
            f"| {name} ({w['start']:.0f}-{w['end']:.0f} s) | {s['requests']} | {o.get('ok', 0)} | "
            f"{w['open']['dropped']} | {w['open']['corrupted']} | {o.get('rejected', 0)} | "
            f"{fmt_errors(w.get('errors') or {})} | {fmt_ms(s['ttft']['p50'])} | "
            f"{fmt_ms(s['ttft']['p99'])} | "
            f"{fmt_ms(s['ttft']['p99.9'])} | {fmt_ms(s['itl']['p50'])} | "
            f"{fmt_ms(s['itl']['p99'])} | {fmt_ms(s['tpot']['p50'])} |"
        )
    rows.append("")
    rows.append(
        "Requests, errors and latencies: requests started in the window. Dropped and "
        "corrupted: streams open at any time in the window. ITL: every gap between tokens; "
        "TPOT: a request's mean gap (what guidellm and aiperf call ITL)."
    )
    return "\n".join(rows)


def make_window(records: list[Record], start: float, end: float) -> dict[str, Any]:
    open_ = window_counts(records, start, end)
    return {
        "start": start,
        "end": end,
        "summary": summarize(records, start, end),
        "errors": error_counts(records, start, end),
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


async def _scenario_steps(
    scenario: str, control: PipelineControl, load: LoadRun, pool: str, deadline_s: float
) -> list[str]:
    """Run the rollout or the chaos kill, marking each step on the load's timeline; the
    failures it ran into (empty when it did what it should)."""
    if scenario == "rollout":
        load.mark("rollout_start", pool=pool)
        summary = await control.rollout(pool, {}, deadline_s=deadline_s)
        ok, error = summary.get("ok"), summary.get("error")
        load.mark(
            "rollout_end",
            ok=ok,
            seconds=summary.get("seconds"),
            **({"error": error} if error else {}),
        )
        if not ok:
            return [f"the rollout of pool {pool!r} failed: {error or 'no reason given'}"]
    elif scenario == "chaos":
        victim = await control.kill(pool)
        load.mark("replica_killed", replica=victim["name"], pid=victim["pid"])
        if victim.get("ok") is False:  # --scenario-command's command failed
            return [f"the chaos command failed: {victim.get('error') or 'no reason given'}"]
        by = await control.wait_replaced(victim["name"])
        load.mark("replica_replaced", replica=victim["name"], by=by)
        if by is None and victim.get("pid") is not None:  # a pipeline's replica
            return [f"replica {victim['name']} (pool {pool!r}) was not replaced after its SIGKILL"]
    return []


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
    max_error_rate: float = MAX_ERROR_RATE,
    command: str | None = None,
    engine_metrics: list[str] | None = None,
    discover_engines: bool = False,
) -> dict[str, Any]:
    """Run the load (and the scenario), write the report; the result's `failures` says why
    the run failed (empty when it passed). With `engine_metrics` (engine URLs), the result's
    `engines` holds the prefix-cache hit rate and the load spread over the run."""
    acting = scenario != "steady" and control is not None
    # With a scenario the runner stops the load itself: at --duration, or once the scenario's
    # window is over when the scenario outlasts it (see `stop_load`).
    load = LoadRun(replace(cfg, duration=cfg.duration + MAX_EXTENSION_S) if acting else cfg)
    started = time.time()
    watch: EngineWatch | None = None
    if engine_metrics:
        # A scenario on the pipeline replaces engines: follow them (a rollout's new replicas
        # count, and the old ones up to their last reading, not "unreadable").
        follow = _follow(control) if acting and discover_engines else None
        watch = EngineWatch(list(engine_metrics), discover=follow)
    if watch is not None:
        await watch.start()
    scenario_window: tuple[float, float] | None = None
    scenario_failures: list[str] = []
    stopped_at: float | None = None  # when the runner stopped the load
    with live_progress(console) as prog:
        task_id = prog.add_task(f"bench {scenario}", total=cfg.duration, stats="")
        runner = asyncio.create_task(load.run())
        await asyncio.sleep(0)  # let the run set its t0
        if sampler is not None:
            sampler.start(load.t0)

        async def action() -> None:
            """The scenario at --at; whatever goes wrong in it is a failure of the run, not
            an exception that loses the load's results."""
            nonlocal scenario_window
            await asyncio.sleep(at)
            t0 = load.now()
            assert control is not None  # `acting`
            try:
                scenario_failures.extend(
                    await _scenario_steps(scenario, control, load, pool, deadline_s)
                )
            except Exception as e:
                why = f"{type(e).__name__}: {e}"
                load.mark("scenario_error", error=why)
                scenario_failures.append(f"the {scenario} scenario failed: {why}")
            scenario_window = (t0, load.now() + SCENARIO_MARGIN_S)

        async def stop_load() -> None:
            """Stop the load at --duration; a scenario still running then, or whose window
            (its end + SCENARIO_MARGIN_S) is not over, keeps it running until the window
            ends: what the scenario does is measured under load, all of it."""
            nonlocal stopped_at
            await asyncio.sleep(max(0.0, cfg.duration - load.now()))
            if not act.done():
                console.print(
                    f"[yellow]the {scenario} is still running at --duration "
                    f"({cfg.duration:g} s): the load goes on until it ends, and "
                    f"{SCENARIO_MARGIN_S:g} s more[/]"
                )
                await asyncio.wait([act])
            if scenario_window is not None:
                await asyncio.sleep(max(0.0, scenario_window[1] - load.now()))
            stopped_at = load.now()
            load.stop()

        act = asyncio.create_task(action()) if acting else None
        stopper = asyncio.create_task(stop_load()) if acting else None
        try:
            while not runner.done():
                await asyncio.sleep(0.5)
                now = load.now()
                prog.update(
                    task_id,
                    total=max(cfg.duration, now),
                    completed=now,
                    stats=load.status(),
                )
        finally:
            for t in (act, stopper):
                if t is not None and not t.done():
                    t.cancel()  # the load ended at its cap: the scenario is abandoned
            await asyncio.gather(
                *(t for t in (act, stopper) if t is not None), return_exceptions=True
            )
    if sampler is not None:
        await sampler.stop()
    engines = await watch.stop() if watch is not None else None
    engine_lines = describe(engines)
    records = load.records
    end = max((r.end or r.start) for r in records) if records else 0.0
    windows = {"whole run": make_window(records, 0.0, end + 1)}
    for name, (start, stop) in sweep_windows(cfg).items():
        windows[name] = make_window(records, start, stop)
    spans: list[Span] = []
    if acting and scenario_window is None:
        scenario_failures.append(
            f"the {scenario} did not end within {MAX_EXTENSION_S:g} s after --duration: the "
            "load stopped before it"
        )
    if scenario_window is not None:
        before = (min(10.0, at / 2), scenario_window[0])
        windows["before " + scenario] = make_window(records, *before)
        windows[scenario] = make_window(records, *scenario_window)
        spans = [Span("steady", *before), Span(scenario, *scenario_window)]
        span = f"{scenario_window[0]:.0f}-{scenario_window[1]:.0f} s"
        if stopped_at is None or stopped_at < scenario_window[1] - 0.01:
            scenario_failures.append(f"the {scenario} window ({span}) ends after the load stopped")
        w = windows[scenario]
        if w["summary"]["requests"] == 0 and w["open"]["streams"] == 0:
            scenario_failures.append(
                f"no request was in flight in the {scenario} window ({span}): the {scenario} "
                "ran without load, so nothing was verified"
            )
    failures = verdict(records, max_error_rate)
    if "HTTP 404" in error_counts(records):
        details = (r.detail or "" for r in records)
        # The server answered that it does not serve --model (its error names the model).
        if any(d.startswith("HTTP 404") and "model" in d.lower() for d in details):
            failures.append(
                f"404 from {base_url(cfg.url)}: --model {cfg.model} is not served there "
                "(GET /v1/models lists what is)"
            )
        else:
            failures.append(
                f"404 from {base_url(cfg.url)}/v1/(chat/)completions: is --url the server's "
                "root or its /v1 base URL?"
            )
    load_failures = list(failures)
    failures += scenario_failures
    md = markdown_table(windows, records)
    extra = {"target": base_url(cfg.url), "scenario": scenario}
    extra["verification"] = load.verify_note  # what "corrupted" was checked against, or why not
    if load.verify_mode == "off":
        console.print(f"[yellow]{load.verify_note}[/]")
    if control is not None:
        extra["pipeline"] = await _pipeline_line(control)
    if cfg.workload is not None:
        extra["workload"] = ", ".join(f"{k}={v}" for k, v in asdict(cfg.workload).items())
    extra["engines"] = " / ".join(engine_lines)
    load_line = open_loop_line(cfg, load, windows["whole run"]["summary"])
    if load_line:
        extra["load"] = load_line
    meta = run_metadata(command=command or " ".join(sys.argv), started=started, extra=extra)
    checks = [
        {
            "metric": "requests answered without error, drop or corruption",
            "measured": _outcome_line(records),
            "target": f"errors <= {max_error_rate:.1%}, 0 dropped, 0 corrupted",
            "ok": not load_failures,
        }
    ]
    if acting:
        checks.append(
            {
                "metric": f"{scenario} done, under load",
                "measured": "; ".join(scenario_failures) or "done",
                "target": "done, with streams open in its window",
                "ok": not scenario_failures,
            }
        )
    report = write_report(
        out,
        title=f"unbroken bench: {scenario}",
        config=_config(cfg),
        records=records,
        events=load.events,
        samples=sampler.samples if sampler else [],
        windows=windows,
        markdown=md,
        spans=spans,
        markers=[Marker(e["t"], e["event"]) for e in load.events],
        checks=checks,
        meta=meta,
    )
    if engines is not None:  # results.json gets the numbers, not only the lines
        path = out / "results.json"
        raw = json.loads(path.read_text())
        raw["engines"] = engines
        path.write_text(results_json(raw))
    console.print(md, markup=False, highlight=False)
    if load_line:
        console.print(load_line, markup=False, highlight=False)
    if cfg.sweep:
        console.print(sweep_table(cfg, windows), markup=False, highlight=False)
    for line in engine_lines:
        console.print(line, markup=False, highlight=False)
    console.print(f"report: {report}", markup=False, highlight=False)
    for why in failures:
        console.print(f"FAIL: {why}", markup=False, highlight=False)
    return {
        "windows": windows,
        "report": str(report),
        "events": load.events,
        "failures": failures,
        "engines": engines,
    }


def sweep_windows(cfg: LoadConfig) -> dict[str, tuple[float, float]]:
    """A sweep's windows (`--rate 2,4,8`): each rate's share of the run, by name."""
    if not cfg.sweep:
        return {}
    phase = cfg.phase_s
    return {f"rate {r:g}/s": (i * phase, (i + 1) * phase) for i, r in enumerate(cfg.sweep)}


def sweep_table(cfg: LoadConfig, windows: dict[str, dict[str, Any]]) -> str:
    """Latency against load, a row per rate (the curve `vllm bench serve` users draw a run
    per rate for): what was offered and sent, first-token and per-token times, the errors
    and rejections, and the wait for a slot under --max-concurrency."""
    head = (
        "| offered (req/s) | sent (req/s) | requests | TTFT p50 | TTFT p99 | TPOT p50 "
        "| e2e p99 | errors / rejected |"
    )
    if cfg.max_concurrency is not None:
        head += " slot wait p99 |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    phase = cfg.phase_s
    for r in cfg.sweep:
        s = windows[f"rate {r:g}/s"]["summary"]
        o = s["outcomes"]
        times = [fmt_ms(s[k][p]) for k, p in (("ttft", "p50"), ("ttft", "p99"), ("tpot", "p50"),
                                               ("e2e", "p99"))]  # fmt: skip
        row = (
            f"| {r:g} | {s['requests'] / phase:.2f} | {s['requests']} | {' | '.join(times)} "
            f"| {o.get('error', 0)} / {o.get('rejected', 0)} |"
        )
        if cfg.max_concurrency is not None:
            row += f" {fmt_ms(s['wait']['p99'])} |"
        lines.append(row)
    return "\n".join(lines)


def open_loop_line(cfg: LoadConfig, load: LoadRun, whole: dict[str, Any]) -> str | None:
    """What an open loop offered and sent: the rate asked and the rate achieved (a load
    generator that fell behind says so here), the most requests open at once, the wait for a
    slot under --max-concurrency, and the arrivals left unsent at the end."""
    if cfg.rate is None:
        return None
    offered = (
        f"{', '.join(f'{r:g}' for r in cfg.sweep)} requests/s in turn, {cfg.phase_s:g} s each"
        if cfg.sweep
        else f"{cfg.rate:g} requests/s"
    )
    line = (
        f"open loop: {offered} offered ({cfg.arrival} arrivals), "
        f"{whole['requests_per_s']:.2f}/s sent over the run; at most {load.max_active} open at once"
    )
    if cfg.max_concurrency is not None:
        w = whole["wait"]
        p50, p99 = (1e3 * (w[k] or 0.0) for k in ("p50", "p99"))
        line += (
            f" (--max-concurrency {cfg.max_concurrency}: waited for a slot p50 {p50:.1f} ms, "
            f"p99 {p99:.1f} ms; TTFT is timed from the send)"
        )
    if load.unsent:
        line += f"; {load.unsent} arrivals still waiting for a slot at the end were not sent"
    return line


def _config(cfg: LoadConfig) -> dict[str, Any]:
    """The run's settings for results.json: a workload's run without the random prompts'
    settings it did not use (a review read them as the prompts sent), an open loop's without
    the closed loop's users, and the other way round."""
    d = asdict(cfg)
    if cfg.workload is not None:
        for k in ("prompt_words", "max_tokens", "chat_fraction"):
            d.pop(k, None)
    else:
        d.pop("session_header", None)
    closed = ("users", "spawn_rate")
    for k in closed if cfg.rate is not None else ("rate", "arrival", "max_concurrency"):
        d.pop(k, None)
    return d
