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

The package, one concern per module: `metadata` (Span, Marker, run_metadata, fmt_ms),
`plots` (the PNGs), `html_render` (report.html), `markdown_render` (the notes as HTML) and
`writer` (write_report: every file of a run).
"""

from unbroken.bench.report.metadata import Marker, Span, fmt_ms, run_metadata
from unbroken.bench.report.writer import results_json, write_report

__all__ = ["Marker", "Span", "fmt_ms", "results_json", "run_metadata", "write_report"]
