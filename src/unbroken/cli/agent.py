"""`unbroken agent`: options to `agent.service.run_agent` (or `agent.snapshot.run_once`),
after `agent.statedir` picks the pipeline whose engines it labels."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from unbroken.cli.common import app, bind_error, fail, setup_logging


@app.command()
def agent(
    listen: Annotated[str, typer.Option(help="Exporter address HOST:PORT.")] = "127.0.0.1:9101",
    interval: Annotated[float, typer.Option(help="Process discovery interval (s).")] = 1.0,
    threshold: Annotated[
        float, typer.Option(help="Send-buffer fill counted as backpressure.")
    ] = 0.8,
    once: Annotated[bool, typer.Option("--once", help="Print a snapshot and exit.")] = False,
    duration: Annotated[float, typer.Option(help="With --once: seconds to watch.")] = 3.0,
    allow_slow_probes: Annotated[
        bool,
        typer.Option(
            "--allow-slow-probes",
            help="Also attach where the probe would be single-stepped (slow).",
        ),
    ] = False,
    no_ebpf: Annotated[
        bool, typer.Option("--no-ebpf", help="Use the sock_diag fallback only.")
    ] = False,
    pid_label: Annotated[
        bool,
        typer.Option("--pid-label", help="Label series by pid too (one series set per process)."),
    ] = False,
    state_dir_: Annotated[
        Path | None,
        typer.Option(
            "--state-dir",
            help="State directory of the `unbroken up` whose engines to label "
            "[UNBROKEN_STATE_DIR; under sudo, the invoking user's].",
        ),
    ] = None,
    verbose: Annotated[bool, typer.Option("-v", "--verbose")] = False,
) -> None:
    """eBPF node agent: CUDA call latency (uprobes) and TCP backpressure, per process/pod."""
    from unbroken.agent.service import AgentConfig, run_agent
    from unbroken.agent.statedir import follow_state_dir

    setup_logging(verbose)
    follow_state_dir(state_dir_)
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit():
        fail(f"--listen {listen!r}: expected HOST:PORT")
    if not 0 < threshold <= 1:
        fail("--threshold must be in (0, 1]")
    cfg = AgentConfig(
        host=host,
        port=int(port),
        interval=interval,
        threshold=threshold,
        allow_slow_probes=allow_slow_probes,
        ebpf=not no_ebpf,
        pid_label=pid_label,
    )
    if once:
        from rich.console import Console

        from unbroken.agent.snapshot import run_once

        raise typer.Exit(run_once(cfg, duration, Console()))
    try:
        run_agent(cfg)
    except OSError as e:
        if (msg := bind_error(e, "--listen")) is None:
            raise
        fail(msg)
