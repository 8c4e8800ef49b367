"""What every command family shares: the root typer `app`, the stderr console, logging set-up
and the one-line error exits, so that every command fails the same way (exit 2, `error:`)."""

from __future__ import annotations

import functools
import logging
import sys
from typing import TYPE_CHECKING, NoReturn

import typer

if TYPE_CHECKING:
    from rich.console import Console

# Plain help (rich_markup_mode=None): rich markup would eat bracketed defaults like [8080]
# and cut long option names at 80 columns. Sub-apps need the same setting.
HELP = {"help_option_names": ["-h", "--help"]}
app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings=HELP,
    help="unbroken: serve LLMs with zero dropped token streams.",
)


@functools.cache
def console() -> Console:
    """The stderr console, made on first use: rich costs ~35 ms to import, which the engine's
    start (measured) does not pay."""
    from rich.console import Console

    return Console(stderr=True, soft_wrap=True)


def setup_logging(verbose: bool) -> None:
    """Log lines to stderr, DEBUG with -v."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def fail(message: str, code: int = 2) -> NoReturn:
    """Print `error: message` on stderr and exit (2: bad options or settings)."""
    from rich.markup import escape

    console().print(f"[red]error:[/red] {escape(message)}")
    raise typer.Exit(code)


def bind_error(e: OSError, option: str = "") -> str | None:
    """One line for a listening socket that could not be opened (port in use, no such
    address, privileged port), None for any other OSError. `option`: what chooses the
    address, said after a port in use (a review: the message did not say what to change)."""
    import errno
    import re

    if e.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES):
        return None
    m = re.search(r"\('?([^',]*)'?, (\d+)\)", str(e))
    where = f"{m[1]}:{m[2]}" if m else "the requested address"
    why = {
        errno.EADDRINUSE: "the port is already in use (another process listens there)",
        errno.EADDRNOTAVAIL: "the address is not on this machine",
        errno.EACCES: "permission denied (ports below 1024 need root)",
    }[e.errno]
    if e.errno == errno.EADDRINUSE and option:
        why += f"; choose another with {option}"
    return f"cannot listen on {where}: {why}"
