"""`unbroken controller`: options to `controller.config` (settings, tokens, sources), then
`run_controller`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from unbroken.cli.common import app, bind_error, fail, setup_logging


@app.command()
def controller(
    gateway_admin: Annotated[
        list[str] | None,
        typer.Option(help="A gateway's admin API URL [http://127.0.0.1:8081]. Repeat."),
    ] = None,
    gateway_service: Annotated[
        str | None,
        typer.Option(help="Kubernetes: every gateway replica, NAMESPACE/SERVICE[:PORTNAME]."),
    ] = None,
    admin_token: Annotated[
        str | None,
        typer.Option(envvar="UNBROKEN_ADMIN_TOKEN", help="Bearer token of the admin API."),
    ] = None,
    token_file: Annotated[
        Path | None, typer.Option(help="Read the admin token from this file.")
    ] = None,
    agent_url: Annotated[
        list[str] | None,
        typer.Option("--agent", help="A node agent's URL (omit: engine signals only). Repeat."),
    ] = None,
    agent_service: Annotated[
        str | None,
        typer.Option(help="Kubernetes: every node's agent, NAMESPACE/SERVICE[:PORTNAME]."),
    ] = None,
    config: Annotated[
        Path | None, typer.Option(help="Controller settings (JSON or YAML); flags override.")
    ] = None,
    listen: Annotated[
        str | None, typer.Option(help="HOST:PORT for /metrics, /state, /decisions (8082).")
    ] = None,
    interval: Annotated[float | None, typer.Option(help="Seconds between windows.")] = None,
    full_pool: Annotated[
        list[str] | None,
        typer.Option(help="A full-precision pool (critical traffic stays there). Repeat."),
    ] = None,
    degraded_pool: Annotated[
        list[str] | None,
        typer.Option(help="A degraded-tier (fp8) pool that takes traffic under contention."),
    ] = None,
    supervisor_socket: Annotated[
        str | None,
        typer.Option(help="`unbroken up`'s control socket: enables dynamic precision."),
    ] = None,
    engine_token: Annotated[
        str | None,
        typer.Option(
            envvar="UNBROKEN_ENGINE_TOKEN",
            help="Engines' admin token: their max_num_seqs then follows the cap (simulator).",
        ),
    ] = None,
    engine_token_file: Annotated[
        Path | None, typer.Option(help="Read the engines' admin token from this file.")
    ] = None,
    verbose: Annotated[bool, typer.Option("-v", "--verbose")] = False,
) -> None:
    """The adaptive controller: eBPF and engine signals to caps, tier routing and shedding."""
    from unbroken.controller import run_controller
    from unbroken.controller.config import ControllerConfigError, from_options, settings_from

    setup_logging(verbose)
    try:
        cfg = from_options(
            settings_from(
                config,
                listen=listen,
                interval=interval,
                full_pools=full_pool or (),
                degraded_pools=degraded_pool or (),
            ),
            gateway_admin=gateway_admin or (),
            gateway_service=gateway_service,
            admin_token=admin_token,
            token_file=token_file,
            agent_urls=agent_url or (),
            agent_service=agent_service,
            supervisor_socket=supervisor_socket,
            engine_token=engine_token,
            engine_token_file=engine_token_file,
        )
    except ControllerConfigError as e:
        fail(str(e))
    try:
        run_controller(cfg)
    except OSError as e:
        if (msg := bind_error(e, "--listen")) is None:
            raise
        fail(f"controller: {msg}")
