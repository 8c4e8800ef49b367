"""The running pipeline's commands: `up`, `reload`, `down`, `status`, `rollout`, `scale`,
`drain` and `fault`; each hands its options to `unbroken.pipeline` (`up.py`, `faults.py`) or, for a
drain on Kubernetes, to `k8s.hooks`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from unbroken.cli.common import app, console, fail, setup_logging


@app.command()
def up(
    spec: Annotated[
        Path | None,
        typer.Argument(help="Pipeline spec (YAML). Default: 2 fp16 + 1 fp8 simulated replicas."),
    ] = None,
    port: Annotated[int | None, typer.Option(help="Gateway port [8080].")] = None,
    admin_port: Annotated[int | None, typer.Option(help="Gateway admin port [8081].")] = None,
    controller_port: Annotated[int | None, typer.Option(help="Controller API port [8082].")] = None,
    agent_port: Annotated[int | None, typer.Option(help="Agent exporter port [9101].")] = None,
    no_agent: Annotated[
        bool, typer.Option("--no-agent", help="Do not start the eBPF agent, even as root.")
    ] = False,
    verbose: Annotated[bool, typer.Option("-v", "--verbose")] = False,
) -> None:
    """Run a pipeline on this machine until Ctrl-C or `unbroken down` (SIGHUP reloads the
    spec): engines, gateway, supervision."""
    from unbroken.pipeline.up import run_up

    setup_logging(verbose)
    raise typer.Exit(
        run_up(
            spec,
            port=port,
            admin_port=admin_port,
            controller_port=controller_port,
            agent_port=agent_port,
            agent=False if no_agent else None,
            console=console(),
        )
    )


@app.command()
def reload() -> None:
    """Reload the running pipeline's gateway: re-read the spec `unbroken up` was started with
    (with its flags), apply its gateway settings and pool caps (new gateway workers with the
    code and settings on disk; old ones finish their streams; no connection is refused), and
    list what only a restart applies. A spec that does not validate changes nothing (exit 1)."""
    from unbroken.pipeline.up import reload_cli

    raise typer.Exit(reload_cli())


@app.command()
def down() -> None:
    """Stop the pipeline of the state directory: its supervisor and everything it runs (the
    gateway first, which drains its streams, then the engines within their pools'
    shutdown_timeout_s; it prints how long that may take), or the data plane a killed
    supervisor left serving (docs/pipeline.md)."""
    from unbroken.pipeline.up import down_cli

    raise typer.Exit(down_cli())


@app.command()
def status(
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Show the running pipeline: pools, endpoints, states, in-flight counts."""
    from unbroken.pipeline.up import show_status

    raise typer.Exit(show_status(as_json=as_json))


@app.command()
def rollout(
    pool: Annotated[str, typer.Argument(help="Pool to upgrade, e.g. primary.")],
    profile: Annotated[str | None, typer.Option(help="New simulator profile.")] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option(
            "--set", help="Profile override KEY=VALUE (e.g. decode_base_s=0.015); repeatable."
        ),
    ] = None,
    command: Annotated[
        str | None, typer.Option(help="New engine command (kind: command), shell-style words.")
    ] = None,
    seed: Annotated[int | None, typer.Option(help="New model seed.")] = None,
    health_timeout: Annotated[
        float | None,
        typer.Option(
            help="Stage 1: a new replica must answer /health within this (s) [the pool's "
            "engine.health_timeout_s, 120]; kept for the pool's later replicas."
        ),
    ] = None,
    deadline: Annotated[
        float, typer.Option(help="Drain deadline per old replica (s); then streams are migrated.")
    ] = 30.0,
    warmup_budget: Annotated[
        float, typer.Option(help="Stage 2: the warm-up completion must succeed within this (s).")
    ] = 10.0,
    as_json: Annotated[bool, typer.Option("--json", help="NDJSON progress on stdout.")] = False,
) -> None:
    """Zero-downtime rolling upgrade of a pool of the running `unbroken up`."""
    import shlex

    from unbroken.pipeline.up import rollout_cli

    engine: dict[str, object] = {}
    if profile:
        engine["profile"] = profile
    if seed is not None:
        engine["seed"] = seed
    if health_timeout is not None:
        engine["health_timeout_s"] = health_timeout
    if command:
        engine["kind"] = "command"
        engine["command"] = shlex.split(command)
    overrides: dict[str, float] = {}
    for item in set_ or []:
        key, sep, value = item.partition("=")
        try:
            overrides[key.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep:
            fail(f"--set {item!r}: expected KEY=NUMBER")
    if overrides:
        engine["overrides"] = {
            k: int(v)
            if v.is_integer() and k in ("max_num_seqs", "kv_capacity_tokens", "max_model_len")
            else v
            for k, v in overrides.items()
        }
    raise typer.Exit(
        rollout_cli(
            pool,
            engine,
            drain_deadline_s=deadline,
            warmup_budget_s=warmup_budget,
            as_json=as_json,
            console=console(),
        )
    )


# A negative count is an argument with a range error, not "No such option: -1" (a review).
@app.command(context_settings={"ignore_unknown_options": True})
def scale(
    pool: Annotated[str, typer.Argument(help="An autoscaled pool (replicas: {min, max}).")],
    replicas: Annotated[int, typer.Argument(min=0, help="Replicas wanted, within its [min, max].")],
) -> None:
    """Resize an autoscaled pool of the running `unbroken up` now, as the autoscaler does
    (new replicas through the surge path, a leaving one drained and migrated). The
    autoscaler goes on deciding from demand afterwards."""
    from unbroken.pipeline.up import scale_cli

    raise typer.Exit(scale_cli(pool, replicas, console=console()))


@app.command()
def drain(
    endpoint: Annotated[str, typer.Argument(help="Endpoint name as the gateway lists it.")],
    admin_url: Annotated[
        str | None,
        typer.Option(
            help="Gateway admin URL [from the running pipeline, else http://127.0.0.1:8081]."
        ),
    ] = None,
    deadline: Annotated[
        float | None,
        typer.Option(help="Seconds before remaining streams are migrated [gateway default]."),
    ] = None,
    timeout: Annotated[float, typer.Option(help="Give up waiting after this (s).")] = 600.0,
    every_address: Annotated[
        bool,
        typer.Option(
            help="Drain on every address --admin-url's host resolves to (a headless Service: "
            "each gateway replica)."
        ),
    ] = False,
    token_file: Annotated[
        Path | None, typer.Option(help="Read the admin token from this file.")
    ] = None,
) -> None:
    """Drain an endpoint and wait until it is empty (for preStop hooks)."""
    if every_address or token_file:
        from unbroken.k8s.hooks import main as hooks_main

        if admin_url is None:
            fail("--every-address/--token-file need --admin-url")
        argv = ["drain", endpoint, "--admin", admin_url, "--timeout", str(timeout)]
        argv += ["--every-address"] if every_address else []
        argv += ["--token-file", str(token_file)] if token_file else []
        argv += ["--deadline", str(deadline)] if deadline is not None else []
        raise typer.Exit(hooks_main(argv))
    from unbroken.pipeline.up import drain_cli

    raise typer.Exit(
        drain_cli(
            endpoint, admin_url=admin_url, deadline_s=deadline, timeout=timeout, console=console()
        )
    )


@app.command()
def fault(
    target: Annotated[
        str, typer.Argument(help="Endpoint name as `unbroken status` shows it (with --all: KIND).")
    ],
    kind: Annotated[
        str | None, typer.Argument(help="slow_cuda, hang, fail, crash; or clear, show.")
    ] = None,
    all_: Annotated[
        bool, typer.Option("--all", help="Every engine of the pipeline (a node-wide neighbour).")
    ] = False,
    seconds: Annotated[float | None, typer.Option(help="Duration (s).")] = None,
    extra_ms: Annotated[float | None, typer.Option(help="slow_cuda: ms per CUDA call.")] = None,
    factor: Annotated[float | None, typer.Option(help="slow_cuda: device time multiplier.")] = None,
    jitter_ms: Annotated[float | None, typer.Option(help="slow_cuda: 0..X ms per step.")] = None,
    onset: Annotated[float | None, typer.Option(help="slow_cuda: delay (s).")] = None,
    ramp: Annotated[float | None, typer.Option(help="slow_cuda: ramp up/down seconds.")] = None,
    fraction: Annotated[float | None, typer.Option(help="fail: share of requests failed.")] = None,
    after_tokens: Annotated[int | None, typer.Option(help="fail: after N tokens.")] = None,
    admin_url: Annotated[
        str | None, typer.Option(help="Gateway admin URL [from the running pipeline].")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the engines' answers.")] = False,
) -> None:
    """Inject a fault (or a contention episode) into engines of the running pipeline."""
    from unbroken.pipeline.faults import run_fault

    given = {
        "duration_s": seconds,
        "extra_ms": extra_ms,
        "factor": factor,
        "jitter_ms": jitter_ms,
        "onset_s": onset,
        "ramp_s": ramp,
        "fraction": fraction,
        "after_tokens": after_tokens,
    }
    raise typer.Exit(
        run_fault(
            target,
            kind,
            every=all_,
            params=given,
            admin_url=admin_url,
            as_json=as_json,
            console=console(),
        )
    )
