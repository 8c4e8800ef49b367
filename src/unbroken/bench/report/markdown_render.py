"""The free text of a report (Markdown tables, lists and paragraphs) as HTML, for its Notes
section. Only what the bench and demo write is understood; tables the page already shows
(the windows table, the checks, the seed table) are left out rather than repeated."""

from __future__ import annotations

import re

from unbroken.bench.report.html_render import esc, table, verdict_cell

__all__ = ["markdown_html"]

_MD_ROW = re.compile(r"^\s*\|(.*)\|\s*$")


def markdown_html(md: str, skip_windows: bool, known: frozenset[str] = frozenset()) -> str:
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
                        cells.append(verdict_cell(c.lower() in ("pass", "✓")))
                    else:
                        cells.append(esc(c))
                rows.append(cells)
                low = [c.lower() for c in r]
                classes.append("fail" if "fail" in low else "pass" if "pass" in low else "")
            out.append(table(head, rows, classes))
        elif lines[i].lstrip().startswith("- "):
            items = []
            while i < len(lines) and lines[i].lstrip().startswith("- "):
                items.append(lines[i].lstrip()[2:].strip())
                i += 1
            out.append("<ul>" + "".join(f"<li>{esc(it)}</li>" for it in items) + "</ul>")
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
                out.append(f"<p>{esc(' '.join(para))}</p>")
    return "".join(out)
