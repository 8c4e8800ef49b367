"""`unbroken weights make`: stand-in safetensors shards (`engine.weights.make_weights`)
with a progress bar."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from unbroken.cli.common import HELP, app, console, fail

weights_app = typer.Typer(
    no_args_is_help=True,
    rich_markup_mode=None,
    context_settings=HELP,
    help="Weight files for the engine simulator.",
)
app.add_typer(weights_app, name="weights")


@weights_app.command("make")
def weights_make(
    directory: Annotated[Path, typer.Argument(help="Where to write the shards.")],
    size: Annotated[str, typer.Option(help="Total size, e.g. 512MiB, 1GiB.")] = "1GiB",
    shard_size: Annotated[str, typer.Option(help="Size of one shard file.")] = "256MiB",
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0,
) -> None:
    """Write safetensors shards of random float16 data (a stand-in model)."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    from unbroken.engine.weights import make_weights, parse_size

    try:
        total, shard = parse_size(size), parse_size(shard_size)
    except ValueError as e:
        fail(str(e))
    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        console=console(),
    ) as prog:
        task = prog.add_task(f"writing {directory}", total=total)
        paths = make_weights(
            directory, total, shard_bytes=shard, seed=seed, progress=lambda n: prog.advance(task, n)
        )
    console().print(f"wrote {len(paths)} shard(s), {total / 2**30:.2f} GiB, in {directory}")
