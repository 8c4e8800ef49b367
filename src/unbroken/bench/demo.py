"""`unbroken demo`: the seed article's results table, measured side by side in one run.

1. An engine start with a cold page cache against one after `unbroken prewarm`, on the bare
   disk (the unthrottled reference).
2. Storage is made as slow as the seed's network storage (`throttle`: a cgroup read cap of
   300 MB/s on the weights' disk for this process and every child it starts).
3. The same load and events (`passes`) against two deployments of the same engines:
   - standard: an L4 round-robin Service, no drain, migration, pre-warm or controller, and a
     `kubectl rollout restart` with vLLM's default SIGTERM (in-flight requests aborted);
   - unbroken: the default pipeline (gateway, two-stage readiness, drain + migration,
     pre-warm, controller where the spec runs one).
   200 streaming users with a mix of priorities; a bus-contention episode on an fp16
   replica; a rolling upgrade of the primary pool; a SIGKILL of a primary replica. Every
   response is checked byte for byte against the simulator's deterministic text.
4. The seed table (`seed_table` in results.json: metric, standard, unbroken, unit), the
   checks with their targets, PASS or FAIL, and a report with plots (contention shaded,
   controller decisions as markers). The standard pass's own report is in `standard/`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import secrets
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from unbroken.bench.baseline import StandardDeployment
from unbroken.bench.coldstart import measure_cold_start
from unbroken.bench.load import LoadConfig, Record
from unbroken.bench.passes import (
    PassResult,
    Phases,
    StandardTarget,
    UnbrokenTarget,
    run_pass,
)
from unbroken.bench.report import Marker, Span, fmt_ms, run_metadata, write_report
from unbroken.bench.runner import make_window, markdown_table
from unbroken.bench.stats import nearest_rank, percentile
from unbroken.bench.throttle import SEED_BPS, IoThrottle, ThrottleUnavailable
from unbroken.config.spec import PipelineSpec, default_spec
from unbroken.pipeline.supervisor import Supervisor
from unbroken.wire.http import free_port

__all__ = ["DemoSettings", "run_demo", "seed_rows", "stall_spikes"]

PRIORITIES = {"critical": 0.2, "standard": 0.6, "sheddable": 0.2}


@dataclass(frozen=True)
class DemoSettings:
    users: int = 200
    phases: Phases = field(default_factory=Phases)
    weights_size: str = "1GiB"
    max_ratio: float = 1.5
    stall_ms: float = 150.0
    baseline: bool = True
    storage_bps: int = SEED_BPS
    realtime_loadgen: bool = True  # SCHED_FIFO for the load generator (bench/priority.py)
    # The node agent in unbroken's pass as the default spec has it ("auto": as root with
    # BTF); False: none (its uprobes attach to every engine's CUDA library on the machine)
    agent: bool = True


def stall_spikes(records: list[Record], start: float, end: float, threshold_s: float) -> int:
    """Inter-token gaps longer than `threshold_s` that ended in [start, end)."""
    n = 0
    for r in records:
        if r.ttft is None:
            continue
        t = r.start + r.ttft
        for g in r.gaps:
            t += g
            if g > threshold_s and start <= t < end:
                n += 1
    return n


def _windows(p: PassResult) -> dict[str, dict[str, Any]]:
    m, rs = p.marks, p.records
    w = {
        "steady": make_window(rs, m["steady_start"], m["contention_start"]),
        "contention": make_window(rs, m["contention_start"], m["contention_end"]),
        "rollout": make_window(rs, m["rollout_start"], m["rollout_end"]),
        "chaos": make_window(rs, m["chaos_start"], m["chaos_end"]),
    }
    end = max(((r.end or r.start) for r in rs), default=0.0)
    w["whole run"] = make_window(rs, 0.0, end + 1)
    return w


def _under_load_p999(p: PassResult) -> float | None:
    m = p.marks
    spans = [
        (m["contention_start"], m["contention_end"]),
        (m["rollout_start"], m["rollout_end"]),
    ]
    xs = [
        r.ttft for r in p.records if r.ttft is not None and any(a <= r.start < b for a, b in spans)
    ]
    return percentile(xs, 99.9)


@dataclass
class _Measured:
    """What one pass contributes to the table."""

    cold_start_s: float | None
    prewarm_s: float | None
    p999_ttft_under_load_s: float | None
    p999_ttft_steady_s: float | None
    p999_ttft_contention_s: float | None
    p999_ttft_rollout_s: float | None
    ttfts_contention: int  # how many first tokens each window's p99.9 is taken over
    ttfts_rollout: int
    dropped_rollout: int
    dropped_chaos: int
    dropped_contention: int
    open_rollout: int
    corrupted: int
    stall_spikes: int
    stall_spikes_steady: int
    stall_spikes_last_third: int
    rollout_ok: bool
    rollout_s: float | None
    rejected: int
    errors: int
    requests: int
    critical_reduced_pct: float | None = None


FULL_PRECISIONS = ("fp16", "bf16")


def critical_reduced_pct(records: list[Any], precisions: dict[str, str]) -> float | None:
    """Percent of critical requests' tokens served at reduced precision (first leg): by the
    engine's own X-Unbroken-Profile where it reached the client (through an L4 proxy), else
    by the gateway's X-Unbroken-Endpoint (`POOL-N`) and the pool's precision."""
    total = reduced = 0
    for r in records:
        if r.priority != "critical" or not r.tokens:
            continue
        prec = r.profile
        if prec is None and r.endpoint:
            prec = precisions.get(r.endpoint.rsplit("-", 1)[0])
        if prec is None:
            continue
        total += r.tokens
        if prec not in FULL_PRECISIONS:
            reduced += r.tokens
    return None if not total else round(100.0 * reduced / total, 2)


def measure(
    p: PassResult,
    windows: dict[str, dict[str, Any]],
    stall_s: float,
    precisions: dict[str, str] | None = None,
) -> _Measured:
    m = p.marks

    def p999(name: str) -> float | None:
        return windows[name]["summary"]["ttft"]["p99.9"]

    steady_len = m["contention_start"] - m["steady_start"]
    return _Measured(
        cold_start_s=max((c["start_to_ready_s"] for c in p.cold_starts), default=None),
        prewarm_s=sum(x["seconds"] for x in p.prewarm) if p.prewarm else None,
        p999_ttft_under_load_s=_under_load_p999(p),
        p999_ttft_steady_s=p999("steady"),
        p999_ttft_contention_s=p999("contention"),
        p999_ttft_rollout_s=p999("rollout"),
        ttfts_contention=_ttfts(p.records, m["contention_start"], m["contention_end"]),
        ttfts_rollout=_ttfts(p.records, m["rollout_start"], m["rollout_end"]),
        dropped_rollout=windows["rollout"]["open"]["dropped"],
        dropped_chaos=windows["chaos"]["open"]["dropped"],
        dropped_contention=windows["contention"]["open"]["dropped"],
        open_rollout=windows["rollout"]["open"]["streams"],
        corrupted=windows["whole run"]["open"]["corrupted"],
        stall_spikes=stall_spikes(p.records, m["contention_start"], m["contention_end"], stall_s),
        # the same length of steady state, for scale: spikes the threshold sees without contention
        stall_spikes_last_third=stall_spikes(
            p.records,
            m["contention_end"] - (m["contention_end"] - m["contention_start"]) / 3,
            m["contention_end"],
            stall_s,
        ),
        stall_spikes_steady=stall_spikes(
            p.records, m["steady_start"], m["steady_start"] + steady_len, stall_s
        ),
        rollout_ok=bool(p.rollout.get("ok")),
        rollout_s=p.rollout.get("seconds"),
        rejected=windows["whole run"]["summary"]["outcomes"].get("rejected", 0),
        errors=windows["whole run"]["summary"]["outcomes"].get("error", 0),
        requests=windows["whole run"]["summary"]["requests"],
        critical_reduced_pct=critical_reduced_pct(
            p.records, precisions or {q.name: q.precision for q in default_spec().pools}
        ),
    )


def _ttfts(records: list[Record], start: float, end: float) -> int:
    return sum(1 for r in records if start <= r.start < end and r.ttft is not None)


def rank_note(n: int, p: float = 99.9) -> str:
    """Which request a nearest-rank percentile of `n` is: under 1,000 first tokens the p99.9
    is the slowest one, so one slow moment decides a row; said beside the number."""
    if n <= 0:
        return "no requests"
    k = n - nearest_rank(n, p)
    nth = "the slowest" if k == 1 else f"the {_ordinal(k)} slowest"
    return f"{nth} of {n}"


def _ordinal(k: int) -> str:
    suffix = "th" if 10 <= k % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")
    return f"{k}{suffix}"


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1e3, 1)


def _s(v: float | None) -> float | None:
    return None if v is None else round(v, 2)


def seed_rows(
    std: _Measured | None, ub: _Measured, *, max_ratio: float, stall_ms: float, storage: str
) -> list[dict[str, Any]]:
    """The seed article's table, both columns measured in this run; `ok` judges unbroken."""

    def col(name: str) -> Any:
        return None if std is None else getattr(std, name)

    ratio = (
        ub.p999_ttft_contention_s / ub.p999_ttft_steady_s
        if ub.p999_ttft_contention_s and ub.p999_ttft_steady_s
        else math.nan
    )
    fewer = None if std is None else ub.stall_spikes < std.stall_spikes  # no baseline, no verdict
    return [
        {
            "metric": "cold_start_s",
            "standard": _s(col("cold_start_s")),
            "unbroken": _s(ub.cold_start_s),
            "unit": "s",
            "note": f"replacement replica, process start to /health; {storage}",
        },
        {
            "metric": "prewarm_s",
            "standard": None,
            "unbroken": _s(ub.prewarm_s),
            "unit": "s",
            "note": "unbroken's page-cache pre-warm, done while the old replica still served",
        },
        {
            "metric": "p999_ttft_ms_under_load",
            "standard": _ms(col("p999_ttft_under_load_s")),
            "unbroken": _ms(ub.p999_ttft_under_load_s),
            "unit": "ms",
            "note": "requests started in the rollout and contention windows",
        },
        {
            "metric": "p999_ttft_ms_steady",
            "standard": _ms(col("p999_ttft_steady_s")),
            "unbroken": _ms(ub.p999_ttft_steady_s),
            "unit": "ms",
        },
        {
            "metric": "p999_ttft_ms_contention",
            "standard": _ms(col("p999_ttft_contention_s")),
            "unbroken": _ms(ub.p999_ttft_contention_s),
            "unit": "ms",
            "target": f"<= {max_ratio:g}x steady",
            "ok": ratio <= max_ratio,
            "note": f"p99.9 = {rank_note(ub.ttfts_contention)} first tokens",
        },
        {
            "metric": "dropped_streams_rollout",
            "standard": col("dropped_rollout"),
            "unbroken": ub.dropped_rollout,
            "unit": "streams",
            "target": "0",
            "ok": ub.dropped_rollout == 0,
            "note": f"of {ub.open_rollout} open (unbroken)"
            + ("" if std is None else f", {std.open_rollout} open (standard)"),
        },
        {
            "metric": "dropped_streams_chaos",
            "standard": col("dropped_chaos"),
            "unbroken": ub.dropped_chaos,
            "unit": "streams",
            "target": "0",
            "ok": ub.dropped_chaos == 0,
        },
        {
            "metric": "corrupted_streams",
            "standard": col("corrupted"),
            "unbroken": ub.corrupted,
            "unit": "streams",
            "target": "0",
            "ok": ub.corrupted == 0,
        },
        {
            "metric": "stall_spikes",
            "standard": col("stall_spikes"),
            "unbroken": ub.stall_spikes,
            "unit": "gaps",
            "target": "fewer than standard",
            "ok": fewer,
            "note": f"inter-token gaps > {stall_ms:g} ms in the contention window "
            f"(same length of steady state: {ub.stall_spikes_steady} unbroken"
            + ("" if std is None else f", {std.stall_spikes_steady} standard")
            + f"; the window's last third alone: {ub.stall_spikes_last_third} unbroken"
            + ("" if std is None else f", {std.stall_spikes_last_third} standard")
            + ")",
        },
        {
            "metric": "critical_tokens_reduced_precision_pct",
            "standard": col("critical_reduced_pct"),
            "unbroken": ub.critical_reduced_pct,
            "unit": "%",
            "target": "<= 1 (fp16 has room)",
            "ok": ub.critical_reduced_pct is not None and ub.critical_reduced_pct <= 1.0,
            "note": "share of critical requests' tokens served by the fp8 pool (by where each "
            "stream started); the demo's fp16 pool has room for all critical work",
        },
        {
            "metric": "rejected_requests",
            "standard": col("rejected"),
            "unbroken": ub.rejected,
            "unit": "requests",
            "note": "429/503 answers over the whole run (unbroken sheds sheddable requests "
            "with Retry-After when nothing has room; the users wait and retry)",
        },
        {
            "metric": "failed_requests",
            "standard": col("errors"),
            "unbroken": ub.errors,
            "unit": "requests",
            "note": "no response or another HTTP error, whole run; of "
            f"{ub.requests} requests (unbroken)"
            + ("" if std is None else f", {std.requests} (standard)"),
        },
    ]


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def print_table(console: Console, t: Table) -> None:
    """Print `t` whole: on a terminal rich fits it to the window, but into a pipe or a CI log
    the console's width is 80 and rich would cut cells with an ellipsis, so measure the
    table's natural width and print at that."""
    if console.is_terminal:
        console.print(t)
        return
    wide = console.options.update(max_width=10_000)
    width = Measurement.get(console, wide, t).maximum
    before = console.width  # print(width=) is capped at the console's width: widen it
    console.width = max(width, before)
    try:
        console.print(t)
    finally:
        console.width = before


def checks_table(checks: list[dict[str, Any]]) -> Table:
    t = Table(title="checks")
    for c in ("check", "measured", "target", "verdict"):
        t.add_column(c)
    for c in checks:
        ok = c.get("ok")
        t.add_row(
            str(c["metric"]),
            str(c["measured"]),
            str(c["target"]),
            "[green]pass[/green]" if ok else "[red]FAIL[/red]",
        )
    return t


def verdict_line(checks: list[dict[str, Any]]) -> str:
    """The demo's last line: PASS, or FAIL with every failing check, measured against its
    target (a check may carry its own `reason`, a sentence that says it better)."""
    failed = [c for c in checks if not c.get("ok")]
    if not failed:
        return f"PASS: all {len(checks)} checks"
    why = "; ".join(
        c.get("reason") or f"{c['metric']}: {c['measured']} (target {c['target']})" for c in failed
    )
    return f"FAIL ({len(failed)} of {len(checks)} checks): {why}"


def print_verdict(console: Console, results: dict[str, Any]) -> bool:
    """Print every check of `results` (results.json's shape) with its verdict, then the
    verdict and its reason on the last line. Returns whether every check passed."""
    checks = list(results.get("checks") or [])
    print_table(console, checks_table(checks))
    line = verdict_line(checks)
    passed = line.startswith("PASS")
    console.print(line, style="green" if passed else "red", markup=False, highlight=False)
    return passed


def _print_seed(console: Console, rows: list[dict[str, Any]]) -> str:
    t = Table(title="the seed's results table, measured: standard deployment vs unbroken")
    for c in ("metric", "standard", "unbroken", "unit", "target", ""):
        t.add_column(c)
    md = [
        "| metric | standard | unbroken | unit | target | |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        ok = r.get("ok")
        mark = "" if ok is None else ("[green]✓[/green]" if ok else "[red]✗[/red]")
        t.add_row(
            r["metric"],
            _fmt(r["standard"]),
            _fmt(r["unbroken"]),
            r["unit"],
            r.get("target", ""),
            mark,
        )
        md.append(
            f"| {r['metric']} | {_fmt(r['standard'])} | {_fmt(r['unbroken'])} | {r['unit']} | "
            f"{r.get('target', '')} | {'' if ok is None else ('pass' if ok else 'FAIL')} |"
        )
    print_table(console, t)
    for r in rows:
        if r.get("note"):
            console.print(f"  {r['metric']}: {r['note']}")
    notes = "\n".join(f"- {r['metric']}: {r['note']}" for r in rows if r.get("note"))
    return "\n".join(md) + "\n\n" + notes


def _checks(
    ub: _Measured, rows: list[dict[str, Any]], cold: dict[str, float], max_ratio: float
) -> list[dict[str, Any]]:
    ratio = (
        ub.p999_ttft_rollout_s / ub.p999_ttft_steady_s
        if ub.p999_ttft_rollout_s and ub.p999_ttft_steady_s
        else math.nan
    )
    checks: list[dict[str, Any]] = [
        {
            "metric": "engine start on the bare disk, cold page cache vs pre-warmed",
            "measured": f"{cold['cold_start_s']:.2f} s vs {cold['warm_start_s']:.2f} s "
            f"({cold['cold_start_s'] / cold['warm_start_s']:.2f}x); weight load "
            f"{cold['cold_load_s']:.2f} s vs {cold['warm_load_s']:.2f} s, "
            f"{cold['bytes'] / 2**30:.2f} GiB",
            "target": "measured",
            "ok": True,
        },
        {
            "metric": "p99.9 TTFT, during rolling upgrade",
            "measured": f"{fmt_ms(ub.p999_ttft_rollout_s)} ({ratio:.2f}x steady; "
            f"{rank_note(ub.ttfts_rollout)} first tokens)",
            "target": f"<= {max_ratio:g}x steady",
            "ok": ratio <= max_ratio,
            "reason": f"p99.9 TTFT during the rolling upgrade {fmt_ms(ub.p999_ttft_rollout_s)} "
            f"is {ratio:.2f}x steady (target <= {max_ratio:g}x)",
        },
        {
            "metric": "rolling upgrade of primary (2 replicas)",
            "measured": f"{ub.rollout_s or math.nan:.1f} s, "
            + ("ok" if ub.rollout_ok else "FAILED"),
            "target": "ok",
            "ok": ub.rollout_ok,
        },
        {
            "metric": "dropped SSE streams during contention",
            "measured": str(ub.dropped_contention),
            "target": "0",
            "ok": ub.dropped_contention == 0,
        },
    ]
    for r in rows:
        if r.get("ok") is not None:
            checks.append(
                {
                    "metric": r["metric"],
                    "measured": f"{_fmt(r['unbroken'])} {r['unit']} "
                    f"(standard: {_fmt(r['standard'])})",
                    "target": r["target"],
                    "ok": bool(r["ok"]),
                }
            )
    return checks


def _spans(p: PassResult) -> list[Span]:
    m = p.marks
    return [
        Span("steady", m["steady_start"], m["contention_start"]),
        Span("contention", m["contention_start"], m["contention_end"]),
        Span("rollout", m["rollout_start"], m["rollout_end"]),
        Span("chaos", m["chaos_start"], m["chaos_end"]),
    ]


def _markers(p: PassResult) -> list[Marker]:
    out = [Marker(e["t"], e["event"]) for e in p.events if not e["event"].endswith("_start")]
    for d in p.decisions:
        what = d.get("action") or "decision"
        out.append(Marker(float(d["t"]), f"controller: {what} {d.get('endpoint', '')}".strip()))
    return out


def _spec(weights_size: str, agent: bool = True) -> PipelineSpec:
    spec = default_spec()
    if not agent:
        spec.agent.enabled = False
    spec.gateway.port, spec.gateway.admin_port = free_port(), free_port()
    ctl = getattr(spec, "controller", None)
    if ctl is not None and hasattr(ctl, "port"):
        ctl.port = free_port()
    for pool in spec.pools:
        pool.weights_size = weights_size
    return spec


def _make_state(out: Path, name: str) -> tuple[Path, str, Path]:
    state = out / name
    shutil.rmtree(state, ignore_errors=True)
    state.mkdir(parents=True)
    token = secrets.token_urlsafe(16)
    token_file = state / "admin-token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    return state, token, token_file


async def _demo(console: Console, out: Path, s: DemoSettings) -> int:
    out.mkdir(parents=True, exist_ok=True)
    state, token, token_file = _make_state(out, "state")
    spec = _spec(s.weights_size, s.agent)
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
    throttle: IoThrottle | None = None
    if s.storage_bps <= 0:
        storage = "storage not throttled (--storage-mbps 0): both columns read the bare disk"
    else:
        try:
            throttle = IoThrottle.create(weights, s.storage_bps)
            storage = f"storage: {throttle.describe()}"
        except ThrottleUnavailable as e:
            storage = f"storage NOT throttled ({e}): both columns read the bare disk"
    console.print(storage)
    cfg = LoadConfig(
        url="",
        users=s.users,
        spawn_rate=max(10.0, s.users / 5),
        duration=3600,
        priorities=PRIORITIES,
    )
    std_res: PassResult | None = None
    # Only the processes that read weights (engines, the pre-warm) go behind the throttle:
    # the seed's network storage holds the weights, while code and libraries are local. (With
    # the whole demo inside it, every module a process imported mid-run queued behind the
    # pre-warm's reads, the load generator's clock included.)
    readers = throttle.add if throttle is not None else None
    throttled: int | None = None
    try:
        if s.baseline:
            b_state, b_token, b_file = _make_state(out, "state-standard")
            dep = StandardDeployment(
                _spec(s.weights_size, s.agent), state=b_state, token=b_token, token_file=b_file
            )
            dep.sup.weight_readers = readers
            cfg.url = dep.url
            std_res = await run_pass(
                StandardTarget(dep), cfg, s.phases, console, realtime=s.realtime_loadgen
            )
        sup.weight_readers = readers
        cfg.url = sup.gateway_url
        ub_res = await run_pass(
            UnbrokenTarget(sup), cfg, s.phases, console, realtime=s.realtime_loadgen
        )
    finally:
        if throttle is not None:
            with contextlib.suppress(OSError):
                throttled = throttle.read_bytes()
            with contextlib.suppress(OSError):
                throttle.remove()
    return _verdict(console, out, s, cfg, cold, storage, std_res, ub_res, throttled)


def _verdict(
    console: Console,
    out: Path,
    s: DemoSettings,
    cfg: LoadConfig,
    cold: dict[str, float],
    storage: str,
    std_res: PassResult | None,
    ub_res: PassResult,
    throttled_bytes: int | None = None,
) -> int:
    stall_s = s.stall_ms / 1e3
    ub_w = _windows(ub_res)
    ub = measure(ub_res, ub_w, stall_s)
    std_w = _windows(std_res) if std_res else None
    std = measure(std_res, std_w, stall_s) if std_res and std_w else None
    rows = seed_rows(std, ub, max_ratio=s.max_ratio, stall_ms=s.stall_ms, storage=storage)
    seed_md = _print_seed(console, rows)
    checks = _checks(ub, rows, cold, s.max_ratio)
    passed = all(c["ok"] for c in checks)
    lag_ms = {
        r.name: {
            "p50": _ms(percentile(r.loop_lag, 50)),
            "p99": _ms(percentile(r.loop_lag, 99)),
            "max": _ms(max(r.loop_lag, default=None)),
            "late": [[round(t, 3), _ms(x)] for t, x in r.loop_late],
            "sched": r.sched,
        }
        for r in (std_res, ub_res)
        if r is not None
    }
    lag = "; ".join(
        f"{n} p99 {v['p99']} ms, max {v['max']} ms ({len(v['late'])} wake-ups >= 30 ms late, "
        f"{v['sched']} policy)"
        for n, v in lag_ms.items()
    )
    config = {
        "users": cfg.users,
        "priorities": PRIORITIES,
        "phases": {
            "steady_s": s.phases.steady_s,
            "contention": vars(s.phases.contention),
            "recovery_s": s.phases.recovery_s,
            "drain_deadline_s": s.phases.deadline_s,
            "settle_s": s.phases.settle_s,
            "after_kill_s": s.phases.after_kill_s,
            "ramp_s": s.phases.ramp_s,
        },
        "stall_ms": s.stall_ms,
        "storage": storage,
        "storage_throttled_read_bytes": throttled_bytes,  # what went through the cap, both passes
        "passes": ["standard", "unbroken"] if std_res else ["unbroken"],
        "contended": {
            "unbroken": ub_res.contended,
            **({"standard": std_res.contended} if std_res else {}),
        },
        "cold_start_unthrottled": cold,
        "loadgen_loop_lag_ms": lag_ms,
    }
    console.print(f"load generator's event-loop lag (its own measuring delay): {lag}")
    windows = dict(ub_w)
    if std_w is not None:
        windows.update({f"standard: {k}": v for k, v in std_w.items()})
    md = (
        seed_md
        + "\n\n"
        + "\n".join(
            f"| {c['metric']} | {c['measured']} | {c['target']} | {'pass' if c['ok'] else 'FAIL'} |"
            for c in checks
        )
        + f"\n\nPipeline start: unbroken {ub_res.boot_s:.1f} s"
        + (f", standard {std_res.boot_s:.1f} s" if std_res else "")
        + f". Users: {cfg.users}. {storage}. Load generator's event-loop lag: {lag}.\n\n"
        + markdown_table(windows, ub_res.records)
        + "\n"
    )
    meta = run_metadata(
        extra={"note": "2 shared cores: other processes may have run during the demo"}
    )
    if std_res is not None and std_w is not None:
        write_report(
            out / "standard",
            title="unbroken demo: the standard deployment's pass",
            config=config,
            records=std_res.records,
            events=std_res.events,
            samples=[],
            windows=std_w,
            spans=_spans(std_res),
            markers=_markers(std_res),
            meta=meta,
            markdown=markdown_table(std_w, std_res.records),
        )
    report = write_report(
        out,
        title="unbroken demo: standard deployment vs unbroken",
        config={**config, "decisions": ub_res.decisions, "rollout": ub_res.rollout},
        records=ub_res.records,
        events=ub_res.events,
        samples=ub_res.samples,
        windows=windows,
        spans=_spans(ub_res),
        markers=_markers(ub_res),
        checks=checks,
        seed_table=rows,
        meta=meta,
        markdown=md,
    )
    console.print(markdown_table(windows, ub_res.records))
    if not ub_res.decisions:
        console.print("no controller decisions were recorded in the unbroken pass")
    console.print(f"report: {report}")
    passed = print_verdict(console, {"checks": checks})
    return 0 if passed else 1


def run_demo(*, out: Path, settings: DemoSettings, console: Console) -> int:
    # uvloop, as the gateway and the engines: the load generator shares the cores with what
    # it measures, and every microsecond it spends per chunk is taken from them.
    import uvloop

    with contextlib.suppress(KeyboardInterrupt):
        return uvloop.run(_demo(console, out, settings))
    return 130
