"""`write_report`: the files of one run in its report directory: results.json (every
record, sample, event and window, for a later look), summary.md (the caller's Markdown), the
PNG plots and report.html. Spans default to the windows' ranges, markers to the events, the
metadata to this run's."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson

from unbroken.bench.load import Record
from unbroken.bench.report.html_render import render_page
from unbroken.bench.report.markdown_render import markdown_html
from unbroken.bench.report.metadata import Marker, Span, as_marker, as_span, run_metadata
from unbroken.bench.report.plots import plots

__all__ = ["results_json", "write_report"]


def results_json(raw: Any) -> str:
    """results.json's text: strict JSON (RFC 8259), a non-finite number as null (orjson's
    rule). Python's `json` wrote `Infinity` and `NaN` (a spread over an engine that served
    nothing, a ratio over an empty window), which jq, JavaScript and most readers refuse."""
    return orjson.dumps(raw, default=str, option=orjson.OPT_NON_STR_KEYS).decode()


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
    report's path. See the package docstring (`unbroken.bench.report`) for each argument."""
    out.mkdir(parents=True, exist_ok=True)
    span_list = (
        [as_span(s) for s in spans]
        if spans is not None
        else [
            Span(n, w["start"], w["end"])
            for n, w in windows.items()
            if n != "whole run" and w.get("end") is not None
        ]
    )
    marker_list = (
        [as_marker(m) for m in markers]
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
    (out / "results.json").write_text(results_json(raw))
    (out / "summary.md").write_text(markdown)
    images = plots(out, records, samples, span_list, marker_list)

    notes = ""
    if markdown.strip():
        known = {str(c.get("metric", "")) for c in [*(checks or []), *(seed_table or [])]}
        notes = markdown_html(markdown, skip_windows=bool(windows), known=frozenset(known - {""}))
    page = render_page(
        out,
        title=title,
        meta=meta_d,
        config=config,
        events=events,
        windows=windows,
        notes=notes,
        checks=checks,
        seed_table=seed_table,
        images=images,
        spans=span_list,
        markers=marker_list,
    )
    (out / "report.html").write_text(page)
    return out / "report.html"


def _compact(r: Record) -> dict[str, Any]:
    d = r.as_dict()
    d["gaps"] = [round(g, 5) for g in r.gaps]
    for k in ("start", "ttft", "end", "e2e", "tpot"):
        if d.get(k) is not None:
            d[k] = round(d[k], 5)
    return d
