"""The report's PNG plots (matplotlib, Agg): TTFT by request start, ITL percentiles, dropped
and migrated streams, streams per endpoint and queue depth (from the gateway sampler), tokens
per second. Every plot shares one look and one time axis: spans shaded, markers numbered with
stacked labels that never overlap, the same margins so the axes line up on the page."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from unbroken.bench.load import Record
from unbroken.bench.report.metadata import Marker, Span

__all__ = ["plots"]

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


def _token_times(r: Record) -> list[float]:
    if r.ttft is None:
        return []
    t = r.start + r.ttft
    out = [t]
    for g in r.gaps:
        t += g
        out.append(t)
    return out


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


def plots(
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
