"""`unbroken demo`: the whole story on one machine, measured.

Measures an engine start with a cold page cache against one after `unbroken prewarm`, then
starts the default pipeline (two fp16 replicas, one fp8 replica, one gateway), drives 200
streaming users, and while they stream: a steady window, a rolling upgrade of the primary
pool, then a SIGKILL of one primary replica (the supervisor replaces it). Every response is
checked byte for byte against the simulator's deterministic text. Prints the seed article's
results table with the rows measured here, and writes a report with plots.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from unbroken.bench.coldstart import measure_cold_start
from unbroken.bench.control import PipelineControl, Sampler
from unbroken.bench.load import LoadConfig, LoadRun, Record
from unbroken.bench.report import fmt_ms, write_report
from unbroken.bench.runner import live_progress, make_window, markdown_table
from unbroken.config.spec import default_spec
from unbroken.pipeline.supervisor import Supervisor
from unbroken.wire.http import free_port

__all__ = ["run_demo"]


async def _demo(
    console: Console,
    out: Path,
    users: int,
    steady_s: float,
    deadline_s: float,
    weights_size: str,
    max_ratio: float,
) -> int:
    state = out / "state"
    shutil.rmtree(state, ignore_errors=True)
    state.mkdir(parents=True)
    spec = default_spec()
    spec.gateway.port, spec.gateway.admin_port = free_port(), free_port()
    for pool in spec.pools:
        pool.weights_size = weights_size
    token = secrets.token_urlsafe(16)
    token_file = state / "admin-token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    sup = Supervisor(spec, state=state, token=token, token_file=token_file)
    loop = asyncio.get_running_loop()
    with console.status("measuring a cold engine start against a pre-warmed one") as st:
        await loop.run_in_executor(None, sup.prepare_weights, lambda m: st.update(m))
        primary = spec.pools[0]
        port = free_port()
        weights = sup.weights_for(primary)
        assert weights is not None
        cold = await measure_cold_start(
            sup.engine_argv(primary, "127.0.0.1", port), f"http://127.0.0.1:{port}", weights
        )
    t_boot = time.monotonic()
    with console.status("starting the default pipeline") as st:
        await sup.start(lambda m: st.update(m))
    boot_s = time.monotonic() - t_boot
    console.print(
        f"pipeline up in {boot_s:.1f} s: gateway {sup.gateway_url}, {len(sup.replicas)} replicas"
    )
    control = PipelineControl(str(state / "supervisor.sock"))
    sampler = Sampler(sup.admin_url, token)
    cfg = LoadConfig(
        url=sup.gateway_url,
        users=users,
        spawn_rate=max(10.0, users / 10),
        duration=3600,
        priorities={"critical": 0.1, "standard": 0.8, "sheddable": 0.1},
    )
    load = LoadRun(cfg)
    marks: dict[str, float] = {}
    phase = "ramp-up"
    try:
        with live_progress(console) as prog:
            tid = prog.add_task("demo", total=None, stats="")
            runner = asyncio.create_task(load.run())
            await asyncio.sleep(0)
            sampler.start(load.t0)

            async def tick() -> None:
                while True:
                    prog.update(
                        tid,
                        description=phase,
                        stats=load.status(),
                    )
                    await asyncio.sleep(0.5)

            ticker = asyncio.create_task(tick())
            ramp = users / cfg.spawn_rate + 5.0
            await asyncio.sleep(ramp)
            phase = "steady"
            marks["steady_start"] = load.now()
            load.mark("steady_start")
            await asyncio.sleep(steady_s)
            phase = "rolling upgrade of primary"
            marks["rollout_start"] = load.now()
            load.mark("rollout_start", pool="primary")
            summary = await control.rollout(
                "primary", {"overrides": {"decode_base_s": 0.018}}, deadline_s=deadline_s
            )
            marks["rollout_end"] = load.now()
            load.mark("rollout_end", ok=summary.get("ok"), seconds=summary.get("seconds"))
            phase = "settling"
            await asyncio.sleep(8.0)
            phase = "chaos: SIGKILL a primary replica"
            marks["chaos_start"] = load.now()
            victim = await control.kill("primary")
            load.mark("replica_killed", replica=victim["name"], pid=victim["pid"])
            by = await control.wait_replaced(victim["name"])
            load.mark("replica_replaced", replica=victim["name"], by=by)
            await asyncio.sleep(5.0)
            marks["chaos_end"] = load.now()
            phase = "finishing"
            load.stop()
            await runner
            ticker.cancel()
    finally:
        await sampler.stop()
        await sup.stop()
    records = load.records
    windows = {
        "steady": make_window(records, marks["steady_start"], marks["rollout_start"]),
        "rollout": make_window(records, marks["rollout_start"], marks["rollout_end"]),
        "chaos": make_window(records, marks["chaos_start"], marks["chaos_end"]),
    }
    end = max((r.end or r.start) for r in records)
    windows["whole run"] = make_window(records, 0.0, end + 1)
    return _verdict(
        console, out, cfg, load, sampler, windows, records, summary, boot_s, cold, max_ratio
    )


def _verdict(
    console: Console,
    out: Path,
    cfg: LoadConfig,
    load: LoadRun,
    sampler: Sampler,
    windows: dict[str, dict[str, Any]],
    records: list[Record],
    rollout: dict[str, Any],
    boot_s: float,
    cold: dict[str, float],
    max_ratio: float,
) -> int:
    steady = windows["steady"]["summary"]["ttft"]["p99.9"]
    during = windows["rollout"]["summary"]["ttft"]["p99.9"]
    ratio = during / steady if steady and during else float("nan")
    whole = windows["whole run"]
    dropped_r, dropped_c = (
        windows["rollout"]["open"]["dropped"],
        windows["chaos"]["open"]["dropped"],
    )
    corrupted = whole["open"]["corrupted"]
    streams_r, streams_c = (
        windows["rollout"]["open"]["streams"],
        windows["chaos"]["open"]["streams"],
    )
    migrated = [e for e in load.events if e["event"] in ("rollout_end", "replica_replaced")]
    t = Table(title="unbroken demo: the seed's results, measured in this run")
    t.add_column("metric")
    t.add_column("measured")
    t.add_column("target")
    t.add_column("")
    checks = [
        (
            "model cold start (engine to /health), cold cache vs pre-warmed",
            f"{cold['cold_start_s']:.2f} s vs {cold['warm_start_s']:.2f} s "
            f"({cold['cold_start_s'] / cold['warm_start_s']:.2f}x); weight load "
            f"{cold['cold_load_s']:.2f} s vs {cold['warm_load_s']:.2f} s "
            f"({cold['cold_load_s'] / max(cold['warm_load_s'], 1e-6):.1f}x), "
            f"{cold['bytes'] / 2**30:.2f} GiB",
            "measured",
            True,
        ),
        ("p99.9 TTFT, steady window", fmt_ms(steady), "", True),
        (
            "p99.9 TTFT, during rolling upgrade",
            f"{fmt_ms(during)} ({ratio:.2f}x steady)",
            f"<= {max_ratio:g}x steady",
            ratio <= max_ratio,
        ),
        (
            "dropped SSE streams during rollout",
            f"{dropped_r} of {streams_r} open",
            "0",
            dropped_r == 0,
        ),
        (
            "dropped SSE streams during SIGKILL chaos",
            f"{dropped_c} of {streams_c} open",
            "0",
            dropped_c == 0,
        ),
        (
            "streams with corrupted text (whole run)",
            f"{corrupted} of {whole['open']['streams']}",
            "0",
            corrupted == 0,
        ),
        (
            "rolling upgrade of primary (2 replicas)",
            f"{rollout.get('seconds', float('nan')):.1f} s, "
            + ("ok" if rollout.get("ok") else "FAILED"),
            "ok",
            bool(rollout.get("ok")),
        ),
    ]
    for name, value, target, ok in checks:
        t.add_row(name, value, target, "[green]✓[/green]" if ok else "[red]✗[/red]")
    console.print(t)
    md = markdown_table(windows, records)
    md_checks = "\n".join(
        f"| {n} | {v} | {tg} | {'pass' if ok else 'FAIL'} |" for n, v, tg, ok in checks
    )
    full_md = (
        "| metric | measured | target | |\n|---|---|---|---|\n"
        + md_checks
        + f"\n\nPipeline start: {boot_s:.1f} s. Users: {cfg.users}. "
        f"Events: {', '.join(e['event'] + ' @' + format(e['t'], '.1f') for e in migrated)}"
        + "\n\n"
        + md
        + "\n"
    )
    report = write_report(
        out,
        title="unbroken demo",
        config={"users": cfg.users},
        records=records,
        events=load.events,
        samples=sampler.samples,
        windows=windows,
        markdown=full_md,
    )
    console.print(md)
    console.print(f"report: {report}")
    passed = all(ok for *_, ok in checks)
    console.print("[green]PASS[/green]" if passed else "[red]FAIL[/red]")
    return 0 if passed else 1


def run_demo(
    *,
    out: Path,
    users: int = 200,
    steady_s: float = 30.0,
    deadline_s: float = 5.0,
    weights_size: str = "1GiB",
    max_ratio: float = 1.5,
    console: Console,
) -> int:
    with contextlib.suppress(KeyboardInterrupt):
        return asyncio.run(
            _demo(console, out, users, steady_s, deadline_s, weights_size, max_ratio)
        )
    return 130
