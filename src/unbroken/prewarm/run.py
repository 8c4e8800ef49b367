"""`unbroken prewarm`: the command's logic (the CLI only parses)."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn
from rich.table import Table

from unbroken.prewarm.files import PrewarmError, find_weight_files
from unbroken.prewarm.reader import warm_files
from unbroken.prewarm.residency import evict, memory_available, residency

__all__ = ["MAX_THREADS", "run_prewarm"]

MAX_THREADS = 256  # beyond this, threads only contend (and 100,000 took 34 s to start)


def run_prewarm(
    paths: list[str],
    *,
    check: bool,
    do_evict: bool,
    target: float,
    threads: int | None,
    as_json: bool,
    console: Console,
) -> int:
    if threads is not None and not 1 <= threads <= MAX_THREADS:
        console.print(f"error: --threads must be 1..{MAX_THREADS}, got {threads}", markup=False)
        return 2
    try:
        files = find_weight_files(paths)
    except PrewarmError as e:
        console.print(f"error: {e}", markup=False)
        return 2
    total = sum(f.stat().st_size for f in files)
    result: dict[str, Any] = {"files": [str(f) for f in files], "bytes": total}
    try:
        if do_evict:
            for f in files:
                evict(f)
            result["evicted"] = True
        elif not check:
            room, source = memory_available()
            result["memory_available"] = {"bytes": room, "source": source}
            if total > room:
                console.print(
                    f"[yellow]warning:[/yellow] {total / 1e9:.2f} GB of weights but only "
                    f"{room / 1e9:.2f} GB available ({source}): the page cache cannot hold "
                    "them all, so files read first will be evicted by later ones and the "
                    f"residency target of {target:g} % will likely not be reached."
                )
            with Progress(
                "[progress.description]{task.description}",
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                console=console,
                disable=as_json,
            ) as prog:
                task = prog.add_task(f"pre-warming {len(files)} file(s)", total=total)
                stats = warm_files(files, threads=threads, progress=lambda n: prog.advance(task, n))
            result["read"] = {
                "bytes": stats.bytes,
                "seconds": round(stats.seconds, 4),
                "gbps": round(stats.gbps, 3),
                "threads": stats.threads,
                "method": stats.method,
                "ramp": [[n, round(r, 3)] for n, r in stats.thread_history],
            }
        res = [residency(f) for f in files]
        if not check and not do_evict:
            # Pages can be evicted between the read and the check (other readers, memory
            # pressure): read the files found short once more before judging.
            short = [r.path for r in res if r.resident_pages < r.pages]
            if short:
                warm_files(short, threads=threads)
                again = {f: residency(f) for f in short}
                res = [again.get(r.path, r) for r in res]
                result["reread_files"] = len(short)
    except OSError as e:
        console.print(f"[red]error:[/red] {e.filename or ''}: {e.strerror or e}")
        return 2
    resident = sum(r.resident_bytes for r in res)
    pages = sum(r.pages for r in res)
    resident_pages = sum(r.resident_pages for r in res)
    pct = 100.0 * resident_pages / max(1, pages)
    result["residency"] = {
        "percent": _floor(pct),
        "pages": pages,
        "resident_pages": resident_pages,
        "resident_bytes": resident,
        "files": [
            {
                "path": str(r.path),
                "size": r.size,
                "pages": r.pages,
                "resident_pages": r.resident_pages,
                "percent": _floor(r.percent),
            }
            for r in res
        ],
    }
    ok = do_evict or pct >= target
    result["ok"] = ok
    if as_json:
        sys.stdout.write(json.dumps(result, indent=1) + "\n")
    else:
        t = Table(title="page-cache residency")
        for col in ("file", "size", "resident", "%"):
            t.add_column(col, justify="right" if col != "file" else "left")
        for r in res:
            t.add_row(r.path.name, _size(r.size), _size(r.resident_bytes), _pct(r.percent))
        t.add_row("[bold]total[/bold]", _size(total), _size(resident), _pct(pct))
        Console().print(t)
        if "read" in result:
            rd = result["read"]
            console.print(
                f"read {rd['bytes'] / 1e9:.2f} GB in {rd['seconds']:.2f} s "
                f"({rd['gbps']:.2f} GB/s, {rd['threads']} threads, {rd['method']})"
            )
        console.print(f"resident: {resident_pages} of {pages} pages ({_pct(pct)} %)", markup=False)
        if not ok:
            console.print(
                f"error: residency {_pct(pct)} % ({pages - resident_pages} page(s) not "
                f"resident) is below the {target:g} % target",
                markup=False,
            )
    return 0 if ok else 1


def _floor(pct: float, digits: int = 3) -> float:
    """Rounded down: a figure shown never claims more residency than there is."""
    scale = 10**digits
    return int(pct * scale) / scale


def _pct(pct: float) -> str:
    return f"{_floor(pct):.3f}".rstrip("0").rstrip(".")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)
