"""One /metrics for a gateway of several processes: the main process merges its own
exposition with its workers' (`merge_expositions`), counters, histograms and per-worker
gauges added up sample by sample, and keeps what exited workers counted (`retire`) so that no
counter ever goes back. Used by `_main_workers`; text in, text out.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client.utils import floatToGoString

__all__ = ["MAIN_ONLY", "PER_WORKER_GAUGES", "merge_expositions", "retire"]


# Gauges that each worker holds for its own streams: the gateway's value is their sum. Every
# other gauge (endpoints, caps, queue depth, build info) is the main process's, which sees the
# shared admission table.
PER_WORKER_GAUGES = frozenset(
    {
        "unbroken_gateway_active_streams",
        "unbroken_gateway_stream_buffered_bytes",
        "unbroken_gateway_endpoint_slow_clients",
        "unbroken_gateway_pool_demand",
    }
)


# Counters that the main process reads from the shared table for the whole gateway (every
# worker's serving process reports the same total): taken from the main process alone.
MAIN_ONLY = frozenset({"unbroken_gateway_endpoint_requests"})


_Families = dict[str, tuple[str, str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]]


def merge_expositions(main: str, workers: list[str], retired: str = "") -> str:
    """One exposition for the whole gateway: the main process's families, with the workers'
    counters, histograms and per-worker gauges added up sample by sample; `retired` holds
    the counters of workers that have exited (see `retire`), so no counter ever goes back."""
    fams: _Families = {}
    _add(fams, main, lambda typ, name: True, summed=False)
    for text in (*workers, retired):
        _add(
            fams,
            text,
            lambda typ, name: (
                (typ in _SUMMED and name not in MAIN_ONLY) or name in PER_WORKER_GAUGES
            ),
        )
    return _render(fams)


def retire(retired: str, worker: str) -> str:
    """Fold an exited worker's last exposition into the retired counters: its counters,
    histograms and summaries are kept (what it served happened), its gauges are not (it holds
    no stream any more)."""
    fams: _Families = {}
    for text in (retired, worker):
        _add(fams, text, lambda typ, name: typ in _SUMMED and name not in MAIN_ONLY)
    return _render(fams)


_SUMMED = ("counter", "histogram", "summary")


def _add(
    fams: _Families, text: str, keep: Callable[[str, str], bool], *, summed: bool = True
) -> None:
    """Parse `text` into `fams`: the families `keep(type, name)` accepts, each sample added
    to what is there (or, not `summed`, set)."""
    from prometheus_client.parser import text_string_to_metric_families

    for f in text_string_to_metric_families(text):
        if not keep(f.type, f.name):
            continue
        samples = fams.setdefault(f.name, (f.type, f.documentation, {}))[2]
        for s in f.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            samples[key] = samples.get(key, 0.0) + s.value if summed else s.value


def _render(fams: _Families) -> str:
    out: list[str] = []
    for name, (typ, doc, samples) in fams.items():
        doc = doc.replace("\\", r"\\").replace("\n", r"\n")
        # A counter's family is named with its _total, as prometheus_client writes it: under
        # the bare name, parsers (prometheus_client's, Prometheus's metadata) see an untyped
        # x_total series instead of a counter.
        fname = f"{name}_total" if typ == "counter" else name
        out.append(f"# HELP {fname} {doc}\n# TYPE {fname} {typ}\n")
        for (sname, labels), v in samples.items():
            lab = ",".join(
                '{}="{}"'.format(
                    k, str(val).replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
                )
                for k, val in labels
            )
            head = f"{sname}{{{lab}}}" if lab else sname
            out.append(f"{head} {floatToGoString(v)}\n")
    return "".join(out)
