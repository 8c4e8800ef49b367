"""Results of a bench or demo run: raw JSON, a Markdown summary, PNG plots, and one
self-contained report.html (plots embedded as base64, so it can be attached to a ticket).

The input is `write_report`'s keyword arguments; everything beyond the records is optional:

- `windows`: {name: window} as `runner.make_window` builds it (start, end, summary, errors,
  open); rendered as a table, dropped/corrupted/error cells red when non-zero.
- `spans`: [Span(name, start, end)] shaded on every plot (steady, rollout, chaos, contention,
  baseline...; any name, colour by name). Default: the windows' ranges, "whole run" excepted.
- `markers`: [Marker(t, label)] drawn as labelled vertical lines on every plot (events,
  controller decisions). Default: the events. Labels are stacked so they never overlap.
- `checks`: [{"metric", "measured", "target", "ok"}] the verdict table, rows green or red.
- `seed_table`: [{"metric", "standard", "unbroken", "unit"}] (optional "target", "ok") the
  article's comparison table: a standard deployment against unbroken, same run.
- `meta`: {label: value} run metadata (`run_metadata()` fills version, date, command,
  machine); shown at the top.
- `markdown`: free text (Markdown tables and paragraphs) rendered as HTML; a table whose first
  column is "window" is skipped when `windows` is given (it is the same table).
- `samples`: the gateway sampler's rows ({"t", "endpoints": {name: {"inflight", ...}},
  "queue": {priority: n}, "counters": {"migrated": n, "dropped": n}}); plotted when present.

Times are seconds since the load started. Spans and markers may be the dataclasses or dicts
with the same keys.
"""

from __future__ import annotations

import base64
import datetime as dt
import html
import itertools
import json
import math
import os
import platform
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unbroken.bench.load import Record

__all__ = ["Marker", "Span", "fmt_ms", "run_metadata", "write_report"]

COLORS = {
    "ok": "#2b8a3e",
    "dropped": "#c92a2a",
    "corrupted": "#e67700",
    "rejected": "#868e96",
    "error": "#862e9c",
}
SPAN_COLORS = {
    "steady": "#74c0fc",
    "baseline": "#adb5bd",
    "rollout": "#ffd43b",
    "chaos": "#ff8787",
    "contention": "#b197fc",
    "recovery": "#8ce99a",
}
LABEL_ROWS, NUMBER_ROWS = 4, 8  # marker label rows at the top of a plot
_SPARE = itertools.cycle(["#63e6be", "#ffa94d", "#f783ac", "#a9e34b", "#66d9e8"])


@dataclass(frozen=True)
class Span:
    """A named time window, shaded on every plot."""

    name: str
    start: float
    end: float


@dataclass(frozen=True)
class Marker:
    """A moment worth a vertical line and a label (an event, a controller decision)."""

    t: float
    label: str


def fmt_ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f} ms"


def run_metadata(
    *,
    command: str | None = None,
    started: float | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, str]:
    """Version, date, command and machine: what a reader of a report needs to trust it."""
    from unbroken import __version__

    when = dt.datetime.fromtimestamp(started, dt.UTC) if started else dt.datetime.now(dt.UTC)
    meta = {
        "unbroken": __version__,
        "date": when.strftime("%Y-%m-%d %H:%M:%S UTC"),
        "command": command if command is not None else " ".join(sys.argv),
        "machine": f"{platform.node()}: {os.cpu_count()} CPUs, {_memory()}, "
        f"{platform.system()} {platform.release()}, Python {platform.python_version()}",
    }
    meta.update({k: str(v) for k, v in (extra or {}).items()})
    return meta


def _memory() -> str:
    try:
        with open("/proc/meminfo") as f:
            kib = int(f.readline().split()[1])
        return f"{kib / 2**20:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        return "RAM unknown"


# -- plots ------------------------------------------------------------------------------------


def _token_times(r: Record) -> list[float]:
    if r.ttft is None:
        return []
    t = r.start + r.ttft
    out = [t]
    for g in r.gaps:
        t += g
        out.append(t)
    return out


def _span(s: Span | Mapping[str, Any]) -> Span:
    return s if isinstance(s, Span) else Span(str(s["name"]), float(s["start"]), float(s["end"]))


def _marker(m: Marker | Mapping[str, Any]) -> Marker:
    if isinstance(m, Marker):
        return m
    return Marker(float(m["t"]), str(m.get("label") or m.get("event") or ""))


def _pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, math.ceil(p * len(s) / 100) - 1))]


def _binned(
    points: list[tuple[float, float]], width: float, pcts: Sequence[float]
) -> tuple[list[float], dict[float, list[float]]]:
    """Percentiles of the values in each time bin (bin centres, {p: values})."""
    bins: dict[int, list[float]] = {}
    for t, v in points:
        bins.setdefault(int(t // width), []).append(v)
    keys = sorted(bins)
    xs = [(k + 0.5) * width for k in keys]
    return xs, {p: [_pct(bins[k], p) for k in keys] for p in pcts}


class _Plotter:
    """Shared look: shaded spans, stacked marker labels, plain axis labels."""

    def __init__(self, out: Path, spans: list[Span], markers: list[Marker], t_end: float) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        self.plt = plt
        self.out = out
        self.spans = spans
        self.markers = sorted(markers, key=lambda m: m.t)
        self.t_end = max([t_end, *(s.end for s in spans), *(m.t for m in markers), 1.0])
        self.files: list[tuple[str, str]] = []
        self.colors: dict[str, str] = {}

    def color(self, name: str) -> str:
        key = name.split()[0].lower() if name else ""
        if key not in self.colors:
            self.colors[key] = SPAN_COLORS.get(key) or next(_SPARE)
        return self.colors[key]

    @staticmethod
    def _free(rows: list[float], t: float) -> int | None:
        return next((i for i, end in enumerate(rows) if end < t), None)

    def figure(self, height: float = 3.6) -> tuple[Any, Any]:
        fig, ax = self.plt.subplots(figsize=(11, height))
        ax.set_xlim(0, self.t_end * 1.01)
        ax.grid(True, axis="y", alpha=0.3)
        return fig, ax

    def finish(self, fig: Any, ax: Any, name: str, title: str, ylabel: str) -> None:
        for s in self.spans:
            ax.axvspan(s.start, s.end, color=self.color(s.name), alpha=0.18, lw=0)
            ax.annotate(
                s.name,
                ((s.start + s.end) / 2, 0.01),
                xycoords=("data", "axes fraction"),
                ha="center",
                va="bottom",
                fontsize=8,
                color="#343a40",
            )
        # Each marker is numbered (the report's marker table lists them). Its label goes in
        # the first of LABEL_ROWS rows where it does not touch the previous label (width
        # estimated from its length at this font size); when none is free, or the label
        # would run past the right edge, only its number is shown, in the first free row of
        # NUMBER_ROWS. Nothing overlaps.
        px_per_s = 11 * 100 * 0.73 / (self.t_end * 1.01)
        if self.markers:  # headroom: the label rows sit above the data, not on it
            lo, hi = ax.get_ylim()
            if ax.get_yscale() == "log" and lo > 0:
                ax.set_ylim(lo, lo * (hi / lo) ** (1 / 0.68))
            else:
                ax.set_ylim(lo, lo + (hi - lo) / 0.68)
        rows: list[float] = [-math.inf] * NUMBER_ROWS
        for n, m in enumerate(self.markers, 1):
            ax.axvline(m.t, color="#495057", lw=0.8, ls="--")
            text = f"{n} {m.label}"
            fits = m.t + (len(text) * 5.2 + 10) / px_per_s <= self.t_end * 1.01
            row = self._free(rows[:LABEL_ROWS], m.t) if fits else None
            if row is None:
                text = str(n)
                row = self._free(rows, m.t)
            if row is None:
                continue  # the line alone; the table has its label
            rows[row] = m.t + (len(text) * 5.2 + 10) / px_per_s
            ax.annotate(
                text,
                (m.t, 0.97 - 0.08 * row),
                xycoords=("data", "axes fraction"),
                xytext=(2, 0),
                textcoords="offset points",
                ha="left",
                va="top",
                fontsize=7,
                color="#212529",
                bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.8},
            )
        ax.set_xlabel("time since the load started (s)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        if ax.get_yscale() == "log":
            from matplotlib.ticker import FuncFormatter, NullFormatter

            plain = FuncFormatter(lambda v, _pos: f"{v:g}")
            ax.yaxis.set_major_formatter(plain)
            lo, hi = ax.get_ylim()
            # Minor ticks labelled only on a short range, where there are few majors.
            ax.yaxis.set_minor_formatter(plain if hi / max(lo, 1e-12) < 30 else NullFormatter())
            ax.tick_params(axis="y", which="minor", labelsize=7)
        handles, _ = ax.get_legend_handles_labels()
        if handles:
            ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
        # The same margins on every plot, so their time axes line up on the page.
        height = fig.get_figheight()
        fig.subplots_adjust(left=0.07, right=0.80, top=1 - 0.35 / height, bottom=0.55 / height)
        fig.savefig(self.out / name, dpi=100)
        self.plt.close(fig)
        self.files.append((name, title))


def _plots(
    out: Path,
    records: list[Record],
    samples: list[dict[str, Any]],
    spans: list[Span],
    markers: list[Marker],
) -> list[tuple[str, str]]:
    t_end = max([(r.end or r.start) for r in records] + [s["t"] for s in samples] + [1.0])
    pl = _Plotter(out, spans, markers, t_end)
    width = max(1.0, round(t_end / 60))

    fig, ax = pl.figure(4.2)
    for outcome, color in COLORS.items():
        pts = [(r.start, r.ttft * 1e3) for r in records if r.outcome == outcome and r.ttft]
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.scatter(xs, ys, s=4, color=color, label=f"{outcome} ({len(pts)})", alpha=0.5)
    pts = [(r.start, r.ttft * 1e3) for r in records if r.ttft]
    if pts:
        bx, by = _binned(pts, width, (50, 99))
        ax.plot(bx, by[50], color="#1c7ed6", lw=1.6, label=f"p50 per {width:g} s")
        ax.plot(bx, by[99], color="#e03131", lw=1.6, label=f"p99 per {width:g} s")
        ax.set_yscale("log")
    pl.finish(fig, ax, "ttft.png", "Time to first token, by request start", "TTFT (ms, log)")

    gaps = [
        (t, g * 1e3) for r in records for t, g in zip(_token_times(r)[1:], r.gaps, strict=False)
    ]
    fig, ax = pl.figure()
    if gaps:
        bx, by = _binned(gaps, width, (50, 99, 99.9))
        for p, c in ((50, "#1c7ed6"), (99, "#e8590c"), (99.9, "#c92a2a")):
            ax.plot(bx, by[p], color=c, lw=1.4, label=f"ITL p{p:g}")
        ax.set_yscale("log")
    pl.finish(
        fig, ax, "itl.png", f"Gaps between tokens (ITL), percentiles per {width:g} s", "ms (log)"
    )

    fig, ax = pl.figure(3.2)
    nb = int(t_end // width) + 1
    dropped = [0] * nb
    for r in records:
        if r.outcome in ("dropped", "corrupted"):
            dropped[min(nb - 1, int((r.end or r.start) // width))] += 1
    ax.bar(
        [(i + 0.5) * width for i in range(nb)],
        dropped,
        width=width * 0.9,
        color=COLORS["dropped"],
        label=f"dropped+corrupted: {sum(dropped)}",
    )
    mig = [(s["t"], s.get("counters", {}).get("migrated")) for s in samples]
    mig = [(t, v) for t, v in mig if v is not None]
    if mig:
        base = mig[0][1]
        ax.step(
            [t for t, _ in mig],
            [v - base for t, v in mig],
            where="post",
            color="#1971c2",
            lw=1.4,
            label=f"migrated (total): {mig[-1][1] - base:g}",
        )
    ax.set_ylim(bottom=0, top=max([1, *dropped, *((v - mig[0][1]) for _, v in mig)]) * 1.3)
    pl.finish(
        fig, ax, "broken.png", "Streams dropped (client side) and migrated (gateway)", "streams"
    )

    if samples:
        fig, ax = pl.figure()
        eps = sorted({n for s in samples for n in s.get("endpoints", {})})
        xs = [s["t"] for s in samples]
        for name in eps:
            ys = [s["endpoints"].get(name, {}).get("inflight", math.nan) for s in samples]
            ax.plot(xs, ys, lw=1.2, label=name)
        pl.finish(
            fig, ax, "streams.png", "Active streams per endpoint (gateway admin API)", "streams"
        )
        prios = sorted({p for s in samples for p in s.get("queue", {})})
        if prios:
            fig, ax = pl.figure(3.0)
            depth = {p: [s.get("queue", {}).get(p, 0) for s in samples] for p in prios}
            for p in prios:
                ax.plot(xs, depth[p], lw=1.2, label=p)
            ax.set_ylim(0, max(1, *(max(d) for d in depth.values())) * 1.15)
            pl.finish(fig, ax, "queue.png", "Gateway queue depth by priority", "waiting requests")

    times = sorted(itertools.chain.from_iterable(_token_times(r) for r in records))
    if times:
        end = int(times[-1]) + 1
        counts = [0] * end
        for t in times:
            counts[min(int(t), end - 1)] += 1
        fig, ax = pl.figure(3.0)
        ax.plot(range(end), counts, lw=1.2, color="#1c7ed6")
        ax.set_ylim(bottom=0)
        pl.finish(fig, ax, "tokens.png", "Tokens delivered to clients", "tokens per second")
    return pl.files


# -- HTML -------------------------------------------------------------------------------------

_CSS = """
body{font-family:system-ui,sans-serif;max-width:1200px;margin:1.5em auto;padding:0 1em;
color:#212529}
h1{margin-bottom:.2em} h2{margin-top:1.6em;border-bottom:1px solid #dee2e6}
table{border-collapse:collapse;margin:.6em 0;font-size:14px}
th,td{border:1px solid #dee2e6;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f1f3f5} td.num{text-align:right;font-variant-numeric:tabular-nums}
tr.pass td{background:#ebfbee} tr.fail td{background:#fff5f5}
tr td.pass{background:#d3f9d8;color:#2b8a3e;font-weight:600}
tr td.fail{background:#ffe3e3;color:#c92a2a;font-weight:600}
td.bad{color:#c92a2a;font-weight:600}
dl.meta{display:grid;grid-template-columns:max-content auto;gap:2px 12px;font-size:14px}
dl.meta dt{font-weight:600} dl.meta dd{margin:0;font-family:monospace;word-break:break-all}
figure{margin:1em 0} figure img{max-width:100%;border:1px solid #e9ecef}
figcaption{font-size:13px;color:#495057}
.verdict{display:inline-block;padding:4px 12px;border-radius:4px;font-weight:700;color:#fff}
.verdict.pass{background:#2b8a3e} .verdict.fail{background:#c92a2a}
"""


def _e(v: Any) -> str:
    return html.escape(str(v))


def _table(
    head: Sequence[str], rows: Sequence[Sequence[str]], row_class: Sequence[str] = ()
) -> str:
    """Cells are already HTML; a cell that starts with '<td' keeps its own attributes."""
    out = ["<table><thead><tr>", *(f"<th>{_e(h)}</th>" for h in head), "</tr></thead><tbody>"]
    for i, row in enumerate(rows):
        cls = row_class[i] if i < len(row_class) else ""
        out.append(f'<tr class="{cls}">' if cls else "<tr>")
        out += [c if c.startswith("<td") else f"<td>{c}</td>" for c in row]
        out.append("</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _dash(v: Any) -> Any:
    return "-" if v is None else v


def _verdict_cell(ok: Any) -> str:
    if ok is None:
        return "<td></td>"
    return '<td class="pass">pass</td>' if ok else '<td class="fail">FAIL</td>'


def _num(v: Any, bad: bool = False) -> str:
    return f'<td class="num{" bad" if bad else ""}">{_e(v)}</td>'


def _windows_html(windows: Mapping[str, Mapping[str, Any]]) -> str:
    head = [
        "window",
        "span (s)",
        "requests",
        "ok",
        "dropped",
        "corrupted",
        "rejected",
        "errors",
        "TTFT p50",
        "TTFT p99",
        "TTFT p99.9",
        "ITL p50",
        "ITL p99",
        "TPOT p50",
        "tokens/s",
    ]
    rows = []
    for name, w in windows.items():
        s, o = w["summary"], w["summary"]["outcomes"]
        errors = w.get("errors") or {}
        rows.append(
            [
                _e(name),
                _e(f"{w['start']:.1f} to {w['end']:.1f}"),
                _num(s["requests"]),
                _num(o.get("ok", 0)),
                _num(f"{w['open']['dropped']} of {w['open']['streams']}", w["open"]["dropped"] > 0),
                _num(w["open"]["corrupted"], w["open"]["corrupted"] > 0),
                _num(o.get("rejected", 0)),
                _num(", ".join(f"{k}: {v}" for k, v in errors.items()) or "0", bool(errors)),
                *(_num(fmt_ms(s["ttft"][p])) for p in ("p50", "p99", "p99.9")),
                *(_num(fmt_ms(s["itl"][p])) for p in ("p50", "p99")),
                _num(fmt_ms(s["tpot"]["p50"])),
                _num(f"{s['tokens_per_s']:.0f}"),
            ]
        )
    return _table(head, rows) + (
        "<p><small>Requests, errors and latencies: requests started in the window. Dropped and "
        "corrupted: streams open at any time in the window. ITL: every gap between tokens; TPOT: "
        "a request's mean gap after its first token (what guidellm and aiperf call ITL)."
        "</small></p>"
    )


_MD_ROW = re.compile(r"^\s*\|(.*)\|\s*$")


def _markdown_html(md: str, skip_windows: bool, known: frozenset[str] = frozenset()) -> str:
    """Markdown tables, lists and paragraphs as HTML; pass/FAIL cells coloured. Tables that
    repeat what the report already shows are skipped: the windows table (first column
    "window") and any table whose rows are all `known` metrics (the checks, the seed table)."""
    out: list[str] = []
    lines = md.splitlines()
    i = 0
    skip_note = False  # the footnote under a skipped windows table goes with it
    while i < len(lines):
        if _MD_ROW.match(lines[i]):
            block = []
            while i < len(lines) and _MD_ROW.match(lines[i]):
                block.append([c.strip() for c in _MD_ROW.match(lines[i])[1].split("|")])  # type: ignore[index]
                i += 1
            head, body = (
                block[0],
                [r for r in block[1:] if not all(set(c) <= set("-: ") for c in r)],
            )
            if skip_windows and head and head[0].lower() == "window":
                skip_note = True
                continue
            firsts = {r[0] for r in block if r and not set(r[0]) <= set("-: ")} - {"metric"}
            if known and firsts and firsts <= known:
                continue
            skip_note = False
            rows, classes = [], []
            for r in body:
                cells = []
                for c in r:
                    if c.lower() in ("pass", "fail", "✓", "✗"):
                        cells.append(_verdict_cell(c.lower() in ("pass", "✓")))
                    else:
                        cells.append(_e(c))
                rows.append(cells)
                low = [c.lower() for c in r]
                classes.append("fail" if "fail" in low else "pass" if "pass" in low else "")
            out.append(_table(head, rows, classes))
        elif lines[i].lstrip().startswith("- "):
            items = []
            while i < len(lines) and lines[i].lstrip().startswith("- "):
                items.append(lines[i].lstrip()[2:].strip())
                i += 1
            out.append("<ul>" + "".join(f"<li>{_e(it)}</li>" for it in items) + "</ul>")
        else:
            para = []
            while (
                i < len(lines)
                and lines[i].strip()
                and not _MD_ROW.match(lines[i])
                and not lines[i].lstrip().startswith("- ")
            ):
                para.append(lines[i].strip())
                i += 1
            if not para:
                i += 1
            elif skip_note:
                skip_note = False
            else:
                out.append(f"<p>{_e(' '.join(para))}</p>")
    return "".join(out)


def write_report(
    out: Path,
    *,
    title: str,
    config: dict[str, Any],
    records: list[Record],
    events: list[dict[str, Any]],
    samples: list[dict[str, Any]],
    windows: dict[str, dict[str, Any]],
    markdown: str = "",
    spans: Sequence[Span | Mapping[str, Any]] | None = None,
    markers: Sequence[Marker | Mapping[str, Any]] | None = None,
    checks: Sequence[Mapping[str, Any]] | None = None,
    seed_table: Sequence[Mapping[str, Any]] | None = None,
    meta: Mapping[str, Any] | None = None,
) -> Path:
    """Write results.json, summary.md, the plots and report.html into `out`; return the
    report's path. See the module docstring for each argument."""
    out.mkdir(parents=True, exist_ok=True)
    span_list = (
        [_span(s) for s in spans]
        if spans is not None
        else [
            Span(n, w["start"], w["end"])
            for n, w in windows.items()
            if n != "whole run" and w.get("end") is not None
        ]
    )
    marker_list = (
        [_marker(m) for m in markers]
        if markers is not None
        else [Marker(e["t"], e["event"]) for e in events]
    )
    meta_d = dict(meta) if meta is not None else run_metadata()
    raw = {
        "title": title,
        "meta": meta_d,
        "config": config,
        "events": events,
        "windows": windows,
        "spans": [vars(s) for s in span_list],
        "markers": [vars(m) for m in marker_list],
        "checks": list(checks or []),
        "seed_table": list(seed_table or []),
        "samples": samples,
        "records": [_compact(r) for r in records],
    }
    (out / "results.json").write_text(json.dumps(raw, default=str))
    (out / "summary.md").write_text(markdown)
    images = _plots(out, records, samples, span_list, marker_list)

    body = [f"<h1>{_e(title)}</h1>"]
    if checks:
        passed = all(c.get("ok") is not False for c in checks)
        body.append(
            f'<p><span class="verdict {"pass" if passed else "fail"}">'
            f"{'PASS' if passed else 'FAIL'}</span></p>"
        )
    body.append(
        '<dl class="meta">'
        + "".join(f"<dt>{_e(k)}</dt><dd>{_e(v)}</dd>" for k, v in meta_d.items())
        + "</dl>"
    )
    if checks:
        body.append("<h2>Verdict</h2>")
        body.append(
            _table(
                ["metric", "measured", "target", "result"],
                [
                    [
                        _e(c.get("metric", "")),
                        _e(c.get("measured", "")),
                        _e(c.get("target", "")),
                        _verdict_cell(c.get("ok")),
                    ]
                    for c in checks
                ],
                ["pass" if c.get("ok") else "fail" if c.get("ok") is False else "" for c in checks],
            )
        )
    if seed_table:
        body.append("<h2>The article's table: standard deployment vs unbroken, same run</h2>")
        has_target = any("target" in r for r in seed_table)
        head = ["metric", "standard", "unbroken", "unit"] + (["target"] if has_target else [])
        rows = []
        for r in seed_table:
            row = [
                _e(r.get("metric", "")),
                _num(_dash(r.get("standard"))),
                _num(_dash(r.get("unbroken"))),
                _e(r.get("unit", "")),
            ]
            if has_target:
                row.append(_e(r.get("target", "")))
            rows.append(row)
        classes = [
            "pass" if r.get("ok") else "fail" if r.get("ok") is False else "" for r in seed_table
        ]
        body.append(_table(head, rows, classes))
    if windows:
        body.append("<h2>Windows</h2>")
        body.append(_windows_html(windows))
    if markdown.strip():
        known = {str(c.get("metric", "")) for c in [*(checks or []), *(seed_table or [])]}
        notes = _markdown_html(markdown, skip_windows=bool(windows), known=frozenset(known - {""}))
        if notes:
            body.append("<h2>Notes</h2>" + notes)
    body.append("<h2>Plots</h2>")
    for name, caption in images:
        data = base64.b64encode((out / name).read_bytes()).decode()
        body.append(
            f'<figure><img src="data:image/png;base64,{data}" alt="{_e(caption)}">'
            f"<figcaption>{_e(caption)} ({_e(name)})</figcaption></figure>"
        )
    if span_list:
        body.append("<h2>Windows shaded on the plots</h2>")
        body.append(
            _table(
                ["name", "start (s)", "end (s)"],
                [[_e(s.name), _num(f"{s.start:.1f}"), _num(f"{s.end:.1f}")] for s in span_list],
            )
        )
    if marker_list:
        body.append("<h2>Markers on the plots</h2>")
        body.append(
            _table(
                ["#", "t (s)", "label"],
                [
                    [_num(n), _num(f"{m.t:.2f}"), _e(m.label)]
                    for n, m in enumerate(sorted(marker_list, key=lambda m: m.t), 1)
                ],
            )
        )
    if events:
        body.append("<h2>Events</h2>")
        body.append(
            _table(
                ["t (s)", "event", "details"],
                [
                    [
                        _num(f"{e['t']:.2f}"),
                        _e(e["event"]),
                        _e(json.dumps(_details(e), default=str)),
                    ]
                    for e in events
                ],
            )
        )
    body.append(
        "<h2>Configuration</h2><pre>" + _e(json.dumps(config, indent=1, default=str)) + "</pre>"
        '<p>Every record and sample: <a href="results.json">results.json</a> '
        "(beside this file).</p>"
    )
    page = (
        f"<!doctype html><html lang=en><head><meta charset=utf-8><title>{_e(title)}</title>"
        f"<style>{_CSS}</style></head><body>" + "".join(body) + "</body></html>"
    )
    (out / "report.html").write_text(page)
    return out / "report.html"


def _details(e: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in e.items() if k not in ("t", "event")}


def _compact(r: Record) -> dict[str, Any]:
    d = r.as_dict()
    d["gaps"] = [round(g, 5) for g in r.gaps]
    for k in ("start", "ttft", "end", "e2e", "tpot"):
        if d.get(k) is not None:
            d[k] = round(d[k], 5)
    return d
