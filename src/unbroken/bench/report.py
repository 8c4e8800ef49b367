"""Results of a bench run: raw JSON, a Markdown summary, PNG plots, and report.html."""

from __future__ import annotations

import html
import itertools
import json
from pathlib import Path
from typing import Any

from unbroken.bench.load import Record

__all__ = ["fmt_ms", "write_report"]

COLORS = {
    "ok": "#2b8a3e",
    "dropped": "#c92a2a",
    "corrupted": "#e67700",
    "rejected": "#868e96",
    "error": "#862e9c",
}


def fmt_ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f} ms"


def _token_times(r: Record) -> list[float]:
    if r.ttft is None:
        return []
    t = r.start + r.ttft
    out = [t]
    for g in r.gaps:
        t += g
        out.append(t)
    return out


def _plots(
    out: Path, records: list[Record], events: list[dict[str, Any]], samples: list[dict[str, Any]]
) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []

    def marks(ax: Any) -> None:
        for e in events:
            ax.axvline(e["t"], color="#495057", lw=0.8, ls="--")
            ax.annotate(
                e["event"],
                (e["t"], 1),
                xycoords=("data", "axes fraction"),
                rotation=90,
                va="top",
                ha="right",
                fontsize=7,
                color="#495057",
            )

    fig, ax = plt.subplots(figsize=(10, 4))
    for outcome, color in COLORS.items():
        pts = [(r.start, r.ttft * 1e3) for r in records if r.outcome == outcome and r.ttft]
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.scatter(xs, ys, s=4, color=color, label=f"{outcome} ({len(pts)})", alpha=0.6)
    ax.set_yscale("log")
    ax.set_xlabel("request start (s)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("Time to first token")
    ax.legend(loc="upper left", fontsize=8)
    marks(ax)
    fig.tight_layout()
    fig.savefig(out / "ttft.png", dpi=110)
    plt.close(fig)
    names.append("ttft.png")

    if samples:
        fig, ax = plt.subplots(figsize=(10, 4))
        eps = sorted({n for s in samples for n in s["endpoints"]})
        for name in eps:
            xs = [s["t"] for s in samples]
            ys = [s["endpoints"].get(name, {}).get("inflight", float("nan")) for s in samples]
            ax.plot(xs, ys, lw=1.2, label=name)
        ax.set_xlabel("time (s)")
        ax.set_ylabel("active streams")
        ax.set_title("Active streams per endpoint (gateway admin API)")
        ax.legend(loc="upper left", fontsize=7, ncol=3)
        marks(ax)
        fig.tight_layout()
        fig.savefig(out / "streams.png", dpi=110)
        plt.close(fig)
        names.append("streams.png")

    times = sorted(itertools.chain.from_iterable(_token_times(r) for r in records))
    if times:
        end = int(times[-1]) + 1
        counts = [0] * end
        for t in times:
            counts[min(int(t), end - 1)] += 1
        fig, ax = plt.subplots(figsize=(10, 3.5))
        ax.plot(range(end), counts, lw=1.2, color="#1c7ed6")
        ax.set_xlabel("time (s)")
        ax.set_ylabel("tokens / s")
        ax.set_title("Tokens delivered to clients per second")
        marks(ax)
        fig.tight_layout()
        fig.savefig(out / "tokens.png", dpi=110)
        plt.close(fig)
        names.append("tokens.png")
    return names


def write_report(
    out: Path,
    *,
    title: str,
    config: dict[str, Any],
    records: list[Record],
    events: list[dict[str, Any]],
    samples: list[dict[str, Any]],
    windows: dict[str, dict[str, Any]],
    markdown: str,
) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    raw = {
        "title": title,
        "config": config,
        "events": events,
        "windows": windows,
        "samples": samples,
        "records": [_compact(r) for r in records],
    }
    (out / "results.json").write_text(json.dumps(raw))
    (out / "summary.md").write_text(markdown)
    images = _plots(out, records, events, samples)
    body = [f"<h1>{html.escape(title)}</h1>", "<pre>" + html.escape(markdown) + "</pre>"]
    body += [f'<p><img src="{n}" style="max-width:100%"></p>' for n in images]
    body.append(
        "<h2>Events</h2><ul>"
        + "".join(
            f"<li>{e['t']:.2f} s: {html.escape(e['event'])} "
            f"{html.escape(json.dumps(_details(e)))}</li>"
            for e in events
        )
        + "</ul>"
    )
    body.append('<p>Raw samples: <a href="results.json">results.json</a></p>')
    page = (
        "<!doctype html><meta charset=utf-8><title>" + html.escape(title) + "</title>"
        "<body style='font-family:sans-serif;max-width:1100px;margin:auto'>"
        + "".join(body)
        + "</body>"
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
