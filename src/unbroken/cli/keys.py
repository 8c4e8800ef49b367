"""`unbroken key-hash`: an API key's digest, the only form a spec's tenants take
(`config.tenants.key_digest`)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from unbroken.cli.common import app, fail


@app.command("key-hash")
def key_hash(
    key: Annotated[
        str | None,
        typer.Argument(
            help="the API key; read from standard input when omitted (keeps it "
            "out of the shell's history)"
        ),
    ] = None,
) -> None:
    """Print an API key's `sha256:<hex>` form, the only form a spec's tenants.api_keys take."""
    from unbroken.config.tenants import key_digest

    if key is None:
        key = sys.stdin.readline().rstrip("\r\n")
    if not key:
        fail("no key given")
    print(key_digest(key))
