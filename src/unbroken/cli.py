"""The `unbroken` command: parses options and hands off to each component's `run`."""

from __future__ import annotations

import functools
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from rich.console import Console

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="unbroken: serve LLMs with zero dropped token streams.",
)
weights_app = typer.Typer(no_args_is_help=True, help="Weight files for the engine simulator.")
app.add_typer(weights_app, name="weights")


@functools.cache
def _console() -> Console:
    # rich costs ~35 ms to import: the engine's start (measured) does not pay it.
    from rich.console import Console

    return Console(stderr=True, soft_wrap=True)


def _logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _fail(message: str, code: int = 2) -> None:
    _console().print(f"[red]error:[/red] {message}")
    raise typer.Exit(code)


@app.command()
def engine(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    model: Annotated[
        str, typer.Option("--served-model-name", "--model", help="Model name served.")
    ] = "unbroken-sim",
    profile: Annotated[str, typer.Option(help="Timing profile: fp16 or fp8.")] = "fp16",
    weights: Annotated[
        Path | None, typer.Option(help="Directory of *.safetensors to load.")
    ] = None,
    seed: Annotated[int, typer.Option(help="Model seed (same seed, same text).")] = 0,
    eos_rate: Annotated[float, typer.Option(help="Per-token end-of-sequence probability.")] = 0.0,
    max_num_seqs: Annotated[int | None, typer.Option(help="Override the profile.")] = None,
    kv_capacity_tokens: Annotated[int | None, typer.Option(help="Override the profile.")] = None,
    max_model_len: Annotated[int | None, typer.Option(help="Override the profile.")] = None,
    prefill_per_token_s: Annotated[float | None, typer.Option(help="Override the profile.")] = None,
    decode_base_s: Annotated[float | None, typer.Option(help="Override the profile.")] = None,
    decode_per_seq_s: Annotated[float | None, typer.Option(help="Override the profile.")] = None,
    shutdown_timeout: Annotated[
        float, typer.Option(help="On SIGTERM, seconds to let in-flight requests finish.")
    ] = 30.0,
    admin_token: Annotated[
        str | None,
        typer.Option(
            envvar="UNBROKEN_ADMIN_TOKEN", help="Bearer token for /admin (faults, config)."
        ),
    ] = None,
    no_cuda_stub: Annotated[bool, typer.Option(help="Time steps in pure Python.")] = False,
    verbose: Annotated[bool, typer.Option("-v", "--verbose")] = False,
) -> None:
    """Run the vLLM-compatible engine simulator."""
    from unbroken.engine.profiles import get_profile

    _logging(verbose)
    try:
        prof = get_profile(
            profile,
            max_num_seqs=max_num_seqs,
            kv_capacity_tokens=kv_capacity_tokens,
            max_model_len=max_model_len,
            prefill_per_token_s=prefill_per_token_s,
            decode_base_s=decode_base_s,
            decode_per_seq_s=decode_per_seq_s,
        )
    except ValueError as e:
        _fail(str(e))
    if weights is not None and not weights.exists():
        _fail(f"weights path {weights} does not exist")
    loader = None
    if weights is not None:
        # Start reading weights before the server's imports, which then overlap the read.
        from unbroken.engine.weights import WeightError, start_weights

        try:
            loader = start_weights(weights, upload=not no_cuda_stub)
        except (WeightError, OSError) as e:
            _fail(str(e))
    from unbroken.engine.server import EngineConfig, run_engine

    run_engine(
        EngineConfig(
            host=host,
            port=port,
            model_name=model,
            profile=prof,
            seed=seed,
            eos_rate=eos_rate,
            weights=weights,
            weights_loader=loader,
            admin_token=admin_token or None,
            shutdown_timeout=shutdown_timeout,
            use_cuda_stub=not no_cuda_stub,
        )
    )


@app.command()
def gateway(
    endpoint: Annotated[
        list[str] | None,
        typer.Option("--endpoint", "-e", help="Engine URL, optionally POOL=URL. Repeat for more."),
    ] = None,
    config: Annotated[
        Path | None, typer.Option(help="Gateway settings (JSON or YAML); flags override it.")
    ] = None,
    host: Annotated[str | None, typer.Option(help="Address for the OpenAI routes.")] = None,
    port: Annotated[int | None, typer.Option(help="Port for the OpenAI routes [8080].")] = None,
    admin_host: Annotated[str | None, typer.Option(help="Address for the admin API.")] = None,
    admin_port: Annotated[int | None, typer.Option(help="Port for the admin API [8081].")] = None,
    admin_token: Annotated[
        str | None,
        typer.Option(envvar="UNBROKEN_ADMIN_TOKEN", help="Bearer token for the admin API."),
    ] = None,
    priority_header: Annotated[
        str | None, typer.Option(help="Header carrying the priority [x-unbroken-priority].")
    ] = None,
    cap: Annotated[
        int | None, typer.Option(help="Default in-flight cap per endpoint [256].")
    ] = None,
    queue_timeout: Annotated[
        float | None, typer.Option(help="Seconds a request may wait for a slot [30].")
    ] = None,
    no_warmup: Annotated[bool, typer.Option(help="Skip the warm-up completion (stage 2).")] = False,
    verbose: Annotated[bool, typer.Option("-v", "--verbose")] = False,
) -> None:
    """Run the streaming gateway in front of OpenAI-compatible engines (vLLM included)."""
    import yaml
    from pydantic import ValidationError

    from unbroken.gateway import GatewayConfig, StaticEndpoint, run_gateway

    _logging(verbose)
    static = []
    for item in endpoint or []:
        pool, _, url = item.rpartition("=") if "=" in item.split("://", 1)[0] else ("", "", item)
        if not url.startswith(("http://", "https://")):
            _fail(f"--endpoint {item!r}: expected [POOL=]http(s)://HOST:PORT")
        static.append(StaticEndpoint(url=url.rstrip("/"), pool=pool or "default"))
    flags = {
        "host": host,
        "port": port,
        "admin_host": admin_host,
        "admin_port": admin_port,
        "priority_header": priority_header,
        "default_cap": cap,
        "queue_timeout_s": queue_timeout,
    }
    try:
        base = (yaml.safe_load(config.read_text()) or {}) if config else {}
        cfg = GatewayConfig.model_validate(
            {**base, **{k: v for k, v in flags.items() if v is not None}}
        )
    except (OSError, yaml.YAMLError) as e:
        _fail(f"cannot read {config}: {e}")
    except ValidationError as e:
        _fail(str(e))
    run_gateway(cfg, admin_token, static, warmup=not no_warmup)


@app.command()
def up(
    spec: Annotated[
        Path | None,
        typer.Argument(help="Pipeline spec (YAML). Default: 2 fp16 + 1 fp8 simulated replicas."),
    ] = None,
    port: Annotated[int | None, typer.Option(help="Gateway port [8080].")] = None,
    admin_port: Annotated[int | None, typer.Option(help="Gateway admin port [8081].")] = None,
    verbose: Annotated[bool, typer.Option("-v", "--verbose")] = False,
) -> None:
    """Run a pipeline on this machine until Ctrl-C: engines, gateway, supervision."""
    from unbroken.pipeline.up import run_up

    _logging(verbose)
    raise typer.Exit(run_up(spec, port=port, admin_port=admin_port, console=_console()))


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
            _fail(f"--set {item!r}: expected KEY=NUMBER")
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
            console=_console(),
        )
    )


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
) -> None:
    """Drain an endpoint and wait until it is empty (for preStop hooks)."""
    from unbroken.pipeline.up import drain_cli

    raise typer.Exit(
        drain_cli(
            endpoint, admin_url=admin_url, deadline_s=deadline, timeout=timeout, console=_console()
        )
    )


def _range(text: str, what: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError:
        _fail(f"{what}: expected N or LO:HI, got {text!r}")
    if a < 1 or b < a:
        _fail(f"{what}: need 1 <= LO <= HI, got {text!r}")
    return a, b


@app.command()
def bench(
    url: Annotated[
        str | None,
        typer.Option(help="OpenAI-compatible base URL [the running pipeline's gateway]."),
    ] = None,
    scenario: Annotated[str, typer.Option(help="steady, rollout or chaos.")] = "steady",
    users: Annotated[int, typer.Option(help="Concurrent streaming users.")] = 50,
    spawn_rate: Annotated[float, typer.Option(help="Users started per second.")] = 10.0,
    duration: Annotated[float, typer.Option(help="Seconds of load.")] = 60.0,
    at: Annotated[float, typer.Option(help="When the scenario acts (s).")] = 20.0,
    pool: Annotated[str, typer.Option(help="Pool the scenario acts on.")] = "primary",
    deadline: Annotated[float, typer.Option(help="Rollout drain deadline (s).")] = 5.0,
    max_tokens: Annotated[str, typer.Option(help="Output tokens, N or LO:HI.")] = "32:128",
    prompt_words: Annotated[str, typer.Option(help="Prompt words, N or LO:HI.")] = "16:64",
    chat_fraction: Annotated[float, typer.Option(help="Share of chat requests.")] = 0.5,
    priority_mix: Annotated[
        str, typer.Option(help="e.g. critical=0.1,standard=0.8,sheddable=0.1")
    ] = "standard=1",
    slow_fraction: Annotated[float, typer.Option(help="Share of slow-reading users.")] = 0.0,
    verify: Annotated[
        bool, typer.Option(help="Check every text against the simulator's expected output.")
    ] = True,
    model: Annotated[str, typer.Option(help="Model name to request.")] = "unbroken-sim",
    out: Annotated[Path, typer.Option(help="Report directory.")] = Path("bench-out"),
) -> None:
    """Load-test an OpenAI endpoint; measure TTFT/ITL/TPOT, dropped and corrupted streams."""
    import asyncio

    from unbroken.bench.control import PipelineControl, Sampler
    from unbroken.bench.load import LoadConfig
    from unbroken.bench.runner import run_bench
    from unbroken.config.paths import RunInfo, state_dir

    if scenario not in ("steady", "rollout", "chaos"):
        _fail("--scenario must be steady, rollout or chaos")
    mix: dict[str, float] = {}
    for part in priority_mix.split(","):
        k, _, v = part.partition("=")
        try:
            mix[k.strip()] = float(v)
        except ValueError:
            _fail(f"--priority-mix: bad entry {part!r}")
    info = RunInfo.read(state_dir())
    if url is None:
        url = info.gateway_url if info else "http://127.0.0.1:8080"
    control = sampler = None
    if info is not None:
        control = PipelineControl(info.control_socket)
        try:
            token = Path(info.token_file).read_text().strip()
            sampler = Sampler(info.admin_url, token)
        except OSError:
            sampler = None
    elif scenario != "steady":
        _fail(f"scenario {scenario} needs a running `unbroken up`")
    cfg = LoadConfig(
        url=url.rstrip("/"),
        model=model,
        users=users,
        spawn_rate=spawn_rate,
        duration=duration,
        prompt_words=_range(prompt_words, "--prompt-words"),
        max_tokens=_range(max_tokens, "--max-tokens"),
        chat_fraction=chat_fraction,
        priorities=mix,
        slow_fraction=slow_fraction,
        verify=verify,
    )
    asyncio.run(
        run_bench(
            cfg,
            scenario=scenario,
            at=at,
            pool=pool,
            deadline_s=deadline,
            out=out,
            control=control,
            sampler=sampler,
            console=_console(),
        )
    )


@app.command()
def demo(
    users: Annotated[int, typer.Option(help="Streaming users.")] = 200,
    steady: Annotated[float, typer.Option(help="Seconds of the steady window.")] = 30.0,
    deadline: Annotated[float, typer.Option(help="Rollout drain deadline (s).")] = 5.0,
    weights_size: Annotated[str, typer.Option(help="Weights per pool (generated once).")] = "1GiB",
    max_ttft_ratio: Annotated[
        float, typer.Option(help="Pass when rollout p99.9 TTFT <= this x steady.")
    ] = 1.5,
    out: Annotated[Path, typer.Option(help="Report directory.")] = Path("demo-out"),
) -> None:
    """The main job: default pipeline, 200 users, rolling upgrade, SIGKILL; measured."""
    from unbroken.bench.demo import run_demo

    _logging(False)
    logging.getLogger().setLevel(logging.WARNING)
    raise typer.Exit(
        run_demo(
            out=out,
            users=users,
            steady_s=steady,
            deadline_s=deadline,
            weights_size=weights_size,
            max_ratio=max_ttft_ratio,
            console=_console(),
        )
    )


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
        _fail("--check and --evict are exclusive")
    if not 0 <= target <= 100:
        _fail("--target must be between 0 and 100")
    raise typer.Exit(
        run_prewarm(
            paths,
            check=check,
            do_evict=evict,
            target=target,
            threads=threads,
            as_json=as_json,
            console=_console(),
        )
    )


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
        bool, typer.Option(help="Also attach where the probe would be single-stepped (slow).")
    ] = False,
    no_ebpf: Annotated[bool, typer.Option(help="Use the sock_diag fallback only.")] = False,
    verbose: Annotated[bool, typer.Option("-v", "--verbose")] = False,
) -> None:
    """eBPF node agent: CUDA call latency (uprobes) and TCP backpressure, per process/pod."""
    from unbroken.agent.service import AgentConfig, run_agent

    _logging(verbose)
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit():
        _fail(f"--listen {listen!r}: expected HOST:PORT")
    if not 0 < threshold <= 1:
        _fail("--threshold must be in (0, 1]")
    cfg = AgentConfig(
        host=host,
        port=int(port),
        interval=interval,
        threshold=threshold,
        allow_slow_probes=allow_slow_probes,
        ebpf=not no_ebpf,
    )
    if once:
        from rich.console import Console

        from unbroken.agent.snapshot import run_once

        raise typer.Exit(run_once(cfg, duration, Console()))
    run_agent(cfg)


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
        _fail(str(e))
    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        console=_console(),
    ) as prog:
        task = prog.add_task(f"writing {directory}", total=total)
        paths = make_weights(
            directory, total, shard_bytes=shard, seed=seed, progress=lambda n: prog.advance(task, n)
        )
    _console().print(f"wrote {len(paths)} shard(s), {total / 2**30:.2f} GiB, in {directory}")


def main() -> None:
    # Deep-copy protection: the engine's stdout may be a pipe nobody reads.
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    app()
