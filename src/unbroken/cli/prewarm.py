"""`unbroken prewarm`: options to `prewarm.run.run_prewarm` (page-cache load, residency)."""

from __future__ import annotations

from typing import Annotated

import typer

from unbroken.cli.common import app, console, fail


@app.command()
def prewarm(
    paths: Annotated[
        list[str],
        typer.Argument(
            help="Weight files, directories (*.safetensors, *.bin, *.gguf), globs, or HF folders."
        ),
    ],
    check: Annotated[
        bool, typer.Option("--check", help="Report residency only (fincore).")
    ] = False,
    evict: Annotated[
        bool, typer.Option("--evict", help="Drop the files from the page cache.")
    ] = False,
    target: Annotated[float, typer.Option(help="Required residency percent.")] = 100.0,
    threads: Annotated[int | None, typer.Option(help="Reader threads [adaptive].")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Load weight files into the page cache and verify residency (mincore)."""
    from unbroken.prewarm.run import run_prewarm

    if check and evict:
        fail("--check and --evict are exclusive")
    if not 0 <= target <= 100:
        fail("--target must be between 0 and 100")
    raise typer.Exit(
        run_prewarm(
            paths,
            check=check,
            do_evict=evict,
            target=target,
            threads=threads,
            as_json=as_json,
            console=console(),
        )
    )
