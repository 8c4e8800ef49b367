"""report.html: one self-contained page (CSS inline, plots embedded as base64, so it can be
attached to a ticket): verdict, metadata, the checks and the seed table, the windows table,
the notes (rendered by `markdown_render`), the plots, the spans, markers and events, and the
configuration. Also the cell and table primitives the notes use; a verdict cell is coloured
pass or FAIL."""

from __future__ import annotations

import base64
import html
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from unbroken.bench.report.metadata import Marker, Span, fmt_ms

__all__ = ["dash", "esc", "num", "render_page", "table", "verdict_cell"]

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


def esc(v: Any) -> str:
    return html.escape(str(v))


def table(head: Sequence[str], rows: Sequence[Sequence[str]], row_class: Sequence[str] = ()) -> str:
    """Cells are already HTML; a cell that starts with '<td' keeps its own attributes."""
    out = ["<table><thead><tr>", *(f"<th>{esc(h)}</th>" for h in head), "</tr></thead><tbody>"]
    for i, row in enumerate(rows):
        cls = row_class[i] if i < len(row_class) else ""
        out.append(f'<tr class="{cls}">' if cls else "<tr>")
        out += [c if c.startswith("<td") else f"<td>{c}</td>" for c in row]
        out.append("</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def dash(v: Any) -> Any:
    return "-" if v is None else v


def verdict_cell(ok: Any) -> str:
    if ok is None:
        return "<td></td>"
    return '<td class="pass">pass</td>' if ok else '<td class="fail">FAIL</td>'


def num(v: Any, bad: bool = False) -> str:
    return f'<td class="num{" bad" if bad else ""}">{esc(v)}</td>'


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
                esc(name),
                esc(f"{w['start']:.1f} to {w['end']:.1f}"),
                num(s["requests"]),
                num(o.get("ok", 0)),
                num(f"{w['open']['dropped']} of {w['open']['streams']}", w["open"]["dropped"] > 0),
                num(w["open"]["corrupted"], w["open"]["corrupted"] > 0),
                num(o.get("rejected", 0)),
                num(", ".join(f"{k}: {v}" for k, v in errors.items()) or "0", bool(errors)),
                *(num(fmt_ms(s["ttft"][p])) for p in ("p50", "p99", "p99.9")),
                *(num(fmt_ms(s["itl"][p])) for p in ("p50", "p99")),
                num(fmt_ms(s["tpot"]["p50"])),
                num(f"{s['tokens_per_s']:.0f}"),
            ]
        )
    return table(head, rows) + (
        "<p><small>Requests, errors and latencies: requests started in the window. Dropped and "
        "corrupted: streams open at any time in the window. ITL: every gap between tokens; TPOT: "
        "a request's mean gap after its first token (what guidellm and aiperf call ITL)."
        "</small></p>"
    )


def render_page(
    out: Path,
    *,
    title: str,
    meta: Mapping[str, Any],
    config: dict[str, Any],
    events: list[dict[str, Any]],
    windows: Mapping[str, Mapping[str, Any]],
    notes: str,
    checks: Sequence[Mapping[str, Any]] | None,
    seed_table: Sequence[Mapping[str, Any]] | None,
    images: list[tuple[str, str]],
    spans: list[Span],
    markers: list[Marker],
) -> str:
    """The whole page; `notes` is HTML already (empty: no Notes section), `images` are
    (file name in `out`, caption) as `plots` wrote them."""
    body = [f"<h1>{esc(title)}</h1>"]
    if checks:
        passed = all(c.get("ok") is not False for c in checks)
        body.append(
            f'<p><span class="verdict {"pass" if passed else "fail"}">'
            f"{'PASS' if passed else 'FAIL'}</span></p>"
        )
    body.append(
        '<dl class="meta">'
        + "".join(f"<dt>{esc(k)}</dt><dd>{esc(v)}</dd>" for k, v in meta.items())
        + "</dl>"
    )
    if checks:
        body.append("<h2>Verdict</h2>")
        body.append(
            table(
                ["metric", "measured", "target", "result"],
                [
                    [
                        esc(c.get("metric", "")),
                        esc(c.get("measured", "")),
                        esc(c.get("target", "")),
                        verdict_cell(c.get("ok")),
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
                esc(r.get("metric", "")),
                num(dash(r.get("standard"))),
                num(dash(r.get("unbroken"))),
                esc(r.get("unit", "")),
            ]
            if has_target:
                row.append(esc(r.get("target", "")))
            rows.append(row)
        classes = [
            "pass" if r.get("ok") else "fail" if r.get("ok") is False else "" for r in seed_table
        ]
        body.append(table(head, rows, classes))
    if windows:
        body.append("<h2>Windows</h2>")
        body.append(_windows_html(windows))
    if notes:
        body.append("<h2>Notes</h2>" + notes)
    body.append("<h2>Plots</h2>")
    for name, caption in images:
        data = base64.b64encode((out / name).read_bytes()).decode()
        body.append(
            f'<figure><img src="data:image/png;base64,{data}" alt="{esc(caption)}">'
            f"<figcaption>{esc(caption)} ({esc(name)})</figcaption></figure>"
        )
    if spans:
        body.append("<h2>Windows shaded on the plots</h2>")
        body.append(
            table(
                ["name", "start (s)", "end (s)"],
                [[esc(s.name), num(f"{s.start:.1f}"), num(f"{s.end:.1f}")] for s in spans],
            )
        )
    if markers:
        body.append("<h2>Markers on the plots</h2>")
        body.append(
            table(
                ["#", "t (s)", "label"],
                [
                    [num(n), num(f"{m.t:.2f}"), esc(m.label)]
                    for n, m in enumerate(sorted(markers, key=lambda m: m.t), 1)
                ],
            )
        )
    if events:
        body.append("<h2>Events</h2>")
        body.append(
            table(
                ["t (s)", "event", "details"],
                [
                    [
                        num(f"{e['t']:.2f}"),
                        esc(e["event"]),
                        esc(json.dumps(_details(e), default=str)),
                    ]
                    for e in events
                ],
            )
        )
    body.append(
        "<h2>Configuration</h2><pre>" + esc(json.dumps(config, indent=1, default=str)) + "</pre>"
        '<p>Every record and sample: <a href="results.json">results.json</a> '
        "(beside this file).</p>"
    )
    page = (
        f"<!doctype html><html lang=en><head><meta charset=utf-8><title>{esc(title)}</title>"
        f"<style>{_CSS}</style></head><body>" + "".join(body) + "</body></html>"
    )
    return page


def _details(e: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in e.items() if k not in ("t", "event")}
