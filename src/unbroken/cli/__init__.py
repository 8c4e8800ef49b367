"""The `unbroken` command: a typer app whose commands, one module per family, parse their
options and hand off to a `run`-style function of the component that does the work.

- `common`: the root app, the stderr console, logging, the `error:` exits
- `engine`, `gateway`, `agent`, `controller`, `prewarm`: one process or job each
- `pipeline`: up, reload, down, status, rollout, drain, fault (the running pipeline)
- `bench`: bench, demo; `weights`: weights make; `keys`: key-hash; `k8s`: ready, render k8s

Importing a family registers its commands. `unbroken --help` lists commands in the order
they were registered, then the sub-apps in the order they were added, so `_FAMILIES` is that
order (an import list would be sorted by the linter).
"""

from __future__ import annotations

import importlib
import os
from typing import Annotated

import typer

from unbroken.cli.common import app

__all__ = ["app", "main"]

_FAMILIES = (
    "engine",
    "gateway",
    "pipeline",
    "bench",
    "prewarm",
    "agent",
    "controller",
    "weights",  # the `weights` sub-app before `render` (in k8s)
    "keys",
    "k8s",
)


def _version(value: bool) -> None:
    if value:
        from unbroken import __version__

        typer.echo(f"unbroken {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    """unbroken: serve LLMs with zero dropped token streams."""


for _family in _FAMILIES:
    importlib.import_module(f"unbroken.cli.{_family}")


def main() -> None:
    """The console script (`unbroken`) and `python -m unbroken`."""
    # Deep-copy protection: the engine's stdout may be a pipe nobody reads.
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    app()
