"""The `unbroken` command: parses options and hands off to each component's `run`."""

from __future__ import annotations

import functools
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

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
weights_app = typer.Typer(
    no_args_is_help=True,
    rich_markup_mode=None,
    context_settings=HELP,
    help="Weight files for the engine simulator.",
)
app.add_typer(weights_app, name="weights")
render_app = typer.Typer(no_args_is_help=True, help="Render a pipeline for another platform.")
app.add_typer(render_app, name="render")


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


def _fail(message: str, code: int = 2) -> NoReturn:
    from rich.markup import escape

    _console().print(f"[red]error:[/red] {escape(message)}")
    raise typer.Exit(code)


def _read_secret(path: Path, label: str) -> str:
    """A token file's contents, or a one-line error naming `label`."""
    try:
        return path.read_text().strip()
    except OSError as e:
        _fail(f"{label}: {e.strerror}")


def _bind_error(e: OSError) -> str | None:
    """One line for a listening socket that could not be opened (port in use, no such
    address, privileged port), None for any other OSError."""
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
    return f"cannot listen on {where}: {why}"


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def engine(
    ctx: typer.Context,
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
    block_size: Annotated[
        int | None, typer.Option(help="Tokens per KV-cache block (profile: 16).")
    ] = None,
    enable_prefix_caching: Annotated[
        bool | None,
        typer.Option(
            "--enable-prefix-caching/--no-enable-prefix-caching",
            help="Automatic prefix caching, as vLLM v1 (profile: on).",
        ),
    ] = None,
    shutdown_timeout: Annotated[
        float, typer.Option(help="On SIGTERM, seconds to let in-flight requests finish.")
    ] = 30.0,
    admin_token: Annotated[
        str | None,
        typer.Option(
            envvar="UNBROKEN_ADMIN_TOKEN", help="Bearer token for /admin (faults, config)."
        ),
    ] = None,
    no_cuda_stub: Annotated[
        bool, typer.Option("--no-cuda-stub", help="Time steps in pure Python.")
    ] = False,
    verbose: Annotated[bool, typer.Option("-v", "--verbose")] = False,
) -> None:
    """Run the vLLM-compatible engine simulator. vLLM's flags for names and adapters are
    taken too: `--served-model-name NAME ALIAS...`, `--enable-lora`, `--lora-modules
    name=path...`, `--max-loras N`, `--max-lora-rank N`."""
    from unbroken.engine.cli_args import vllm_options
    from unbroken.engine.profiles import get_profile

    _logging(verbose)
    try:
        vllm = vllm_options(ctx.args)
    except ValueError as e:
        _fail(str(e))
    try:
        prof = get_profile(
            profile,
            max_num_seqs=max_num_seqs,
            kv_capacity_tokens=kv_capacity_tokens,
            max_model_len=max_model_len,
            prefill_per_token_s=prefill_per_token_s,
            decode_base_s=decode_base_s,
            decode_per_seq_s=decode_per_seq_s,
            block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
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
            **vllm,
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
    no_warmup: Annotated[
        bool, typer.Option("--no-warmup", help="Skip the warm-up completion (stage 2).")
    ] = False,
    k8s_service: Annotated[
        list[str] | None,
        typer.Option(
            help="Discover a pool from a Service's EndpointSlices: POOL=NAMESPACE/SERVICE[:PORT]."
        ),
    ] = None,
    k8s_peers: Annotated[
        str | None,
        typer.Option(help="This gateway's own Service (NAMESPACE/SERVICE): replicas share caps."),
    ] = None,
    pool_cap: Annotated[
        list[str] | None,
        typer.Option(help="In-flight cap per engine of a pool, all replicas together: POOL=N."),
    ] = None,
    pod_name: Annotated[
        str | None, typer.Option(envvar="POD_NAME", help="This pod's name (with --k8s-peers).")
    ] = None,
    pod_namespace: Annotated[
        str | None, typer.Option(envvar="POD_NAMESPACE", help="This pod's namespace.")
    ] = None,
    workers: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=64,
            help="Serving processes on the one port [one per core, at most 8]. 1: a single "
            "process (no reload). More: a main process (admin API, probes) and N workers; "
            "SIGHUP reloads them without refusing a connection.",
        ),
    ] = None,
    shutdown_timeout: Annotated[
        float,
        typer.Option(
            min=0,
            help="On SIGTERM, seconds open streams may take to finish before they are ended "
            "with an SSE error event (a second SIGTERM ends them at once).",
        ),
    ] = 30.0,
    routing: Annotated[
        str | None,
        typer.Option(
            help="Routing policy: prefix (cache- and session-aware) [default], session, "
            "latency, least_load, round_robin."
        ),
    ] = None,
    verbose: Annotated[bool, typer.Option("-v", "--verbose")] = False,
) -> None:
    """Run the streaming gateway in front of OpenAI-compatible engines (vLLM included)."""
    import yaml
    from pydantic import ValidationError

    from unbroken.gateway import GatewayConfig, StaticEndpoint, default_workers, run_gateway

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
        "routing": routing,
    }

    def load() -> GatewayConfig:  # again at each reload (SIGHUP): the settings on disk now
        base = (yaml.safe_load(config.read_text()) or {}) if config else {}
        return GatewayConfig.model_validate(
            {**base, **{k: v for k, v in flags.items() if v is not None}}
        )

    try:
        cfg = load()
    except (OSError, yaml.YAMLError) as e:
        _fail(f"cannot read {config}: {e}")
    except ValidationError as e:
        _fail(str(e))
    k8s = None
    if k8s_service or k8s_peers:
        from unbroken.k8s.discovery import gateway_settings

        try:
            k8s = gateway_settings(
                k8s_service or [], k8s_peers, pool_cap or [], pod_name, pod_namespace
            )
        except ValueError as e:
            _fail(str(e))
    try:
        run_gateway(
            cfg,
            admin_token,
            static,
            warmup=not no_warmup,
            k8s=k8s,
            workers=workers or default_workers(),
            shutdown_timeout=shutdown_timeout,
            reload_cfg=load,
        )
    except OSError as e:
        if (msg := _bind_error(e)) is None:
            raise
        _fail(msg)


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
    """Run a pipeline on this machine until Ctrl-C: engines, gateway, supervision."""
    from unbroken.pipeline.up import run_up

    _logging(verbose)
    raise typer.Exit(
        run_up(
            spec,
            port=port,
            admin_port=admin_port,
            controller_port=controller_port,
            agent_port=agent_port,
            agent=False if no_agent else None,
            console=_console(),
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
    """Stop the pipeline of the state directory: its supervisor and everything it runs, or
    the data plane a killed supervisor left serving (docs/pipeline.md)."""
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
            _fail("--every-address/--token-file need --admin-url")
        argv = ["drain", endpoint, "--admin", admin_url, "--timeout", str(timeout)]
        argv += ["--every-address"] if every_address else []
        argv += ["--token-file", str(token_file)] if token_file else []
        argv += ["--deadline", str(deadline)] if deadline is not None else []
        raise typer.Exit(hooks_main(argv))
    from unbroken.pipeline.up import drain_cli

    raise typer.Exit(
        drain_cli(
            endpoint, admin_url=admin_url, deadline_s=deadline, timeout=timeout, console=_console()
        )
    )


_FAULT_PARAMS = {
    "slow_cuda": {"duration_s", "extra_ms", "factor", "jitter_ms", "onset_s", "ramp_s"},
    "hang": {"duration_s"},
    "fail": {"duration_s", "fraction", "after_tokens"},
    "crash": set(),
    "clear": set(),
    "show": set(),
}


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
    import asyncio
    import json

    from rich.markup import escape

    from unbroken.clients import AdminError, AdminRejected, EngineAdmin, GatewayAdmin
    from unbroken.config.paths import RunInfo, engine_token_path, state_dir

    if all_:
        if kind is not None:
            _fail("with --all give only KIND (no endpoint name)")
        kind, target = target, ""
    if kind is None:
        _fail(f"give a fault KIND after the endpoint: {', '.join(_FAULT_PARAMS)}")
    if kind not in _FAULT_PARAMS:
        _fail(f"unknown fault kind {kind!r}: expected {', '.join(_FAULT_PARAMS)}")
    if admin_url is not None and not admin_url.startswith(("http://", "https://")):
        _fail(f"--admin-url {admin_url!r}: expected http(s)://HOST:PORT")
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
    params = {k: v for k, v in given.items() if v is not None}
    if bad := sorted(set(params) - _FAULT_PARAMS[kind]):
        flag = {"duration_s": "seconds", "onset_s": "onset", "ramp_s": "ramp"}
        names = ", ".join("--" + flag.get(b, b).replace("_", "-") for b in bad)
        _fail(f"{names}: not an option of {kind}")
    state = state_dir()
    info = RunInfo.read(state)
    if admin_url is None and info is None:
        _fail(f"no pipeline running (UNBROKEN_STATE_DIR={state}): start one with `unbroken up`")
    url = admin_url or (info.admin_url if info else "")
    token = os.environ.get("UNBROKEN_ADMIN_TOKEN")
    if not token:
        try:
            token = Path(info.token_file if info else state / "admin-token").read_text().strip()
        except OSError:
            _fail("no admin token: set UNBROKEN_ADMIN_TOKEN")
    # The engines' own token (`unbroken up` writes one); the admin token where there is none.
    engine_token = os.environ.get("UNBROKEN_ENGINE_TOKEN")
    if not engine_token and (path := engine_token_path(state)).exists():
        engine_token = _read_secret(path, str(path))

    async def one(name: str, engine_url: str) -> tuple[str, object]:
        async with EngineAdmin(engine_url, engine_token or token) as eng:
            if kind == "clear":
                return name, await eng.clear()
            if kind == "show":
                return name, await eng.faults()
            return name, await eng.inject(kind=kind, **params)

    async def go() -> int:
        try:
            async with GatewayAdmin(url, token) as gw:
                eps = await gw.endpoints()
        except AdminError as e:
            _console().print(f"[red]error:[/red] cannot list endpoints at {url}: {escape(str(e))}")
            return 1
        chosen = eps if all_ else [e for e in eps if e["name"] == target]
        if not chosen:
            names = ", ".join(sorted(e["name"] for e in eps)) or "none"
            msg = f"no endpoint named {target!r} (known: {names})"
            _console().print(f"[red]error:[/red] {escape(msg)}")
            return 2
        results = await asyncio.gather(
            *(one(e["name"], e["url"]) for e in chosen), return_exceptions=True
        )
        rc, out = 0, {}
        for e, res in zip(chosen, results, strict=True):
            if isinstance(res, AdminError):
                code = 2 if isinstance(res, AdminRejected) and res.status == 400 else 1
                rc = max(rc, code)
                _console().print(f"[red]error:[/red] {escape(e['name'] + ': ' + str(res))}")
                continue
            if isinstance(res, BaseException):
                raise res
            out[res[0]] = res[1]
            if not as_json:
                print(f"{res[0]}: {json.dumps(res[1])}")
        if as_json:
            print(json.dumps(out, indent=1))
        return rc

    raise typer.Exit(asyncio.run(go()))


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
        bool,
        typer.Option(
            help="Check every text: against the simulator's output, or --reference-url's."
        ),
    ] = True,
    reference_url: Annotated[
        str | None,
        typer.Option(
            help="An engine to verify against (the same greedy request, undisturbed); "
            "without it a target that is not the simulator is not verified."
        ),
    ] = None,
    scenario_command: Annotated[
        str | None,
        typer.Option(
            help="Without `unbroken up`: the shell command that is the rollout or the chaos "
            "on your own engines (e.g. 'kill -TERM 4242'), run at --at."
        ),
    ] = None,
    model: Annotated[str, typer.Option(help="Model name to request.")] = "unbroken-sim",
    max_error_rate: Annotated[
        float, typer.Option(help="Exit 1 when more than this share of requests end in an error.")
    ] = 0.01,
    out: Annotated[Path, typer.Option(help="Report directory.")] = Path("bench-out"),
    workload: Annotated[
        str,
        typer.Option(
            help="random (--prompt-words, --chat-fraction), shared-prefix (inference-perf's "
            "shared_prefix) or multi-turn (conversations carrying their history)."
        ),
    ] = "random",
    num_groups: Annotated[int, typer.Option(help="shared-prefix: system prompts.")] = 10,
    num_prompts_per_group: Annotated[
        int, typer.Option(help="shared-prefix: questions per system prompt.")
    ] = 10,
    system_prompt_len: Annotated[
        int, typer.Option(help="Words of the shared system prompt (multi-turn: 0 for none).")
    ] = 100,
    question_len: Annotated[int, typer.Option(help="Words per question / user turn.")] = 50,
    output_len: Annotated[
        int, typer.Option(help="Tokens per answer (workloads other than random).")
    ] = 50,
    num_turns: Annotated[int, typer.Option(help="multi-turn: turns per conversation.")] = 5,
    seed: Annotated[int, typer.Option(help="Seed of the prompts.")] = 1,
    engine_metrics: Annotated[
        list[str] | None,
        typer.Option(
            help="An engine's URL (repeat for each): its /metrics before and after the run "
            "give the prefix-cache hit rate and the load spread."
        ),
    ] = None,
) -> None:
    """Load-test an OpenAI endpoint; measure TTFT/ITL/TPOT, dropped and corrupted streams.

    --url takes the server root or the SDK-style base URL ending in /v1. Exit 0 when the run
    passed; 1 when no request succeeded, errors exceeded --max-error-rate, or any stream was
    dropped or corrupted (the reasons are printed); 2 for bad options."""

    from unbroken.bench.control import PipelineControl, Sampler
    from unbroken.bench.load import LoadConfig
    from unbroken.bench.runner import run_bench
    from unbroken.bench.workloads import MultiTurn, SharedPrefix, WorkloadSpec
    from unbroken.config.paths import RunInfo, state_dir

    if scenario not in ("steady", "rollout", "chaos"):
        _fail("--scenario must be steady, rollout or chaos")
    spec: WorkloadSpec | None = None
    try:
        if workload == "shared-prefix":
            spec = SharedPrefix(
                num_groups, num_prompts_per_group, system_prompt_len, question_len, output_len
            )
        elif workload == "multi-turn":
            spec = MultiTurn(num_turns, system_prompt_len, question_len, output_len)
        elif workload != "random":
            _fail("--workload must be random, shared-prefix or multi-turn")
    except ValueError as e:
        _fail(f"--workload {workload}: {e}")
    for u in engine_metrics or ():
        if not u.startswith(("http://", "https://")):
            _fail(f"--engine-metrics {u!r}: expected http(s)://HOST:PORT")
    mix: dict[str, float] = {}
    for part in priority_mix.split(","):
        k, _, v = part.partition("=")
        try:
            mix[k.strip()] = float(v)
        except ValueError:
            _fail(f"--priority-mix: bad entry {part!r}")
    if url is not None and not url.startswith(("http://", "https://")):
        _fail(f"--url {url!r}: expected http(s)://HOST:PORT (a trailing /v1 is fine)")
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
    elif scenario != "steady" and scenario_command:
        from unbroken.bench.usercontrol import CommandControl

        control = CommandControl(scenario_command)  # type: ignore[assignment]
    elif scenario != "steady":
        _fail(
            f"scenario {scenario} needs a running `unbroken up`, or --scenario-command with "
            "what to do to your own engines"
        )
    if reference_url is not None and not reference_url.startswith(("http://", "https://")):
        _fail(f"--reference-url {reference_url!r}: expected http(s)://HOST:PORT")
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
        reference_url=reference_url,
        seed=seed,
        workload=spec,
    )
    if not 0 <= max_error_rate <= 1:
        _fail("--max-error-rate must be between 0 and 1")
    import uvloop  # the load generator's CPU per token: 0.64x asyncio's (loadgen_cpu.py)

    result = uvloop.run(
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
            max_error_rate=max_error_rate,
            command=" ".join(["unbroken", *sys.argv[1:]]),
            engine_metrics=engine_metrics,
        )
    )
    raise typer.Exit(1 if result["failures"] else 0)


@app.command()
def demo(
    users: Annotated[int, typer.Option(help="Streaming users.")] = 200,
    steady: Annotated[float, typer.Option(help="Seconds of the steady window.")] = 20.0,
    contention: Annotated[
        float, typer.Option(help="Seconds of the bus-contention episode (slow_cuda).")
    ] = 15.0,
    contention_extra_ms: Annotated[
        float, typer.Option(help="Contention severity: ms added to each CUDA call.")
    ] = 30.0,
    recovery: Annotated[
        float,
        typer.Option(
            help="Seconds from the contention episode's end to the rollout (the controller's "
            "step-by-step undo, ~10 s with the default spec, ends before the rollout's window)."
        ),
    ] = 12.0,
    deadline: Annotated[float, typer.Option(help="Rollout drain deadline (s).")] = 5.0,
    weights_size: Annotated[str, typer.Option(help="Weights per pool (generated once).")] = "1GiB",
    max_ttft_ratio: Annotated[
        float, typer.Option(help="Pass when p99.9 TTFT (rollout, contention) <= this x steady.")
    ] = 1.5,
    stall_ms: Annotated[
        float, typer.Option(help="An inter-token gap above this is a stall spike.")
    ] = 150.0,
    storage_mbps: Annotated[
        float, typer.Option(help="Read cap on the weights' disk for both passes (MB/s).")
    ] = 300.0,
    baseline: Annotated[bool, typer.Option(help="Also run the standard deployment's pass.")] = True,
    realtime_loadgen: Annotated[
        bool,
        typer.Option(
            help="Run the load generator at SCHED_FIFO while it measures (root), so that its "
            "clock is not delayed by what it measures on the same cores."
        ),
    ] = True,
    out: Annotated[Path, typer.Option(help="Report directory.")] = Path("demo-out"),
) -> None:
    """The main job: the seed's results table, a standard deployment vs unbroken, measured."""
    from unbroken.bench.demo import DemoSettings, run_demo
    from unbroken.bench.passes import Contention, Phases

    _logging(False)
    logging.getLogger().setLevel(logging.WARNING)
    if recovery < 0:
        _fail("--recovery must be >= 0 seconds")
    settings = DemoSettings(
        users=users,
        phases=Phases(
            steady_s=steady,
            contention=Contention(seconds=contention, extra_ms=contention_extra_ms),
            recovery_s=recovery,
            deadline_s=deadline,
        ),
        weights_size=weights_size,
        max_ratio=max_ttft_ratio,
        stall_ms=stall_ms,
        baseline=baseline,
        storage_bps=int(storage_mbps * 1e6),
        realtime_loadgen=realtime_loadgen,
    )
    raise typer.Exit(run_demo(out=out, settings=settings, console=_console()))


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


def _agent_state_dir(explicit: Path | None) -> None:
    """Point the agent at the pipeline it labels endpoints for. `sudo unbroken agent` runs
    as root, whose state directory is not the user's: follow SUDO_USER to theirs."""
    if explicit is not None:
        os.environ["UNBROKEN_STATE_DIR"] = str(explicit)
        return
    user = os.environ.get("SUDO_USER")
    if os.environ.get("UNBROKEN_STATE_DIR") or not user or os.geteuid() != 0:
        return
    import pwd

    from unbroken.config.paths import state_dir

    if (state_dir() / "run.json").exists():
        return
    try:
        home = Path(pwd.getpwnam(user).pw_dir)
    except KeyError:
        return
    theirs = home / ".local" / "state" / "unbroken"
    if (theirs / "run.json").exists():
        logging.getLogger("unbroken.agent").info("labelling the pipeline of %s (%s)", user, theirs)
        os.environ["UNBROKEN_STATE_DIR"] = str(theirs)


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

    _logging(verbose)
    _agent_state_dir(state_dir_)
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
        pid_label=pid_label,
    )
    if once:
        from rich.console import Console

        from unbroken.agent.snapshot import run_once

        raise typer.Exit(run_once(cfg, duration, Console()))
    try:
        run_agent(cfg)
    except OSError as e:
        if (msg := _bind_error(e)) is None:
            raise
        _fail(msg)


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
    import yaml
    from pydantic import ValidationError

    from unbroken.config.spec import ControllerSettings
    from unbroken.controller import ControllerConfig, Tiers, run_controller

    _logging(verbose)
    data: dict[str, object] = {}
    if config is not None:
        try:
            loaded = yaml.safe_load(config.read_text())
        except (OSError, yaml.YAMLError) as e:
            _fail(f"--config {config}: {e}")
        if not isinstance(loaded, dict):
            _fail(f"--config {config}: expected a mapping")
        data.update(loaded)
    if listen is not None:
        host, _, port = listen.rpartition(":")
        if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            _fail(f"--listen {listen!r}: expected HOST:PORT")
        data["host"], data["port"] = host, int(port)
    if interval is not None:
        data["interval_s"] = interval
    if full_pool:
        data["full_pools"] = full_pool
    if degraded_pool:
        data["degraded_pools"] = degraded_pool
    try:
        settings = ControllerSettings.model_validate(data)
    except ValidationError as e:
        _fail(
            "controller settings: "
            + "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        )
    token = admin_token
    if token is None and token_file is not None:
        token = _read_secret(token_file, f"--token-file {token_file}")
    if not token:
        _fail("an admin token is needed: --admin-token, UNBROKEN_ADMIN_TOKEN or --token-file")
    if engine_token is None and engine_token_file is not None:
        engine_token = _read_secret(engine_token_file, f"--engine-token-file {engine_token_file}")
    gateways = list(gateway_admin or ([] if gateway_service else ["http://127.0.0.1:8081"]))
    for url in [*gateways, *(agent_url or [])]:
        if not url.startswith(("http://", "https://")):
            _fail(f"{url!r}: expected http(s)://HOST:PORT")
    for opt, ref in (("--gateway-service", gateway_service), ("--agent-service", agent_service)):
        if ref is not None:
            ns, sep, svc = ref.partition("/")
            if not sep or not ns or not svc:
                _fail(f"{opt} {ref!r}: expected NAMESPACE/SERVICE[:PORTNAME]")
    tiers = Tiers(tuple(settings.full_pools), tuple(settings.degraded_pools))
    try:
        run_controller(
            ControllerConfig(
                settings=settings,
                admin_urls=[u.rstrip("/") for u in gateways],
                admin_token=token,
                tiers=tiers,
                agent_urls=[u.rstrip("/") for u in agent_url or []],
                supervisor_socket=supervisor_socket,
                gateway_service=gateway_service,
                agent_service=agent_service,
                engine_token=engine_token or None,
            )
        )
    except OSError as e:
        if (msg := _bind_error(e)) is None:
            raise
        _fail(f"controller: {msg}")


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


@render_app.command("k8s")
def render_k8s(
    spec: Annotated[Path | None, typer.Argument(help="Pipeline spec (YAML) [the default].")] = None,
    out: Annotated[Path, typer.Option(help="Directory for the manifests.")] = Path("k8s-out"),
    namespace: Annotated[str, typer.Option(help="Namespace of the pipeline.")] = "unbroken",
    image: Annotated[str | None, typer.Option(help="The unbroken image.")] = None,
    agent_image: Annotated[str | None, typer.Option(help="The agent's image.")] = None,
    vllm_image: Annotated[str | None, typer.Option(help="The vLLM image.")] = None,
    engine: Annotated[
        str, typer.Option(help="vllm (GPU nodes) or simulator (no GPUs: kind, k3s).")
    ] = "vllm",
    gateway_replicas: Annotated[int, typer.Option(help="Gateway replicas (2 or more).")] = 2,
    agent_old_kernel: Annotated[
        bool, typer.Option(help="Nodes run a kernel older than 5.11: add SYS_RESOURCE.")
    ] = False,
    autoscaler: Annotated[
        str,
        typer.Option(help="Pools with a replica range: keda (ScaledObject), hpa or none."),
    ] = "keda",
    prometheus_url: Annotated[
        str | None,
        typer.Option(
            help="The Prometheus KEDA's trigger reads "
            "[http://prometheus-operated.monitoring.svc:9090]."
        ),
    ] = None,
) -> None:
    """Write Kubernetes manifests for a pipeline spec (one YAML file per object)."""
    from dataclasses import replace

    from unbroken.config.spec import SpecError, load_spec
    from unbroken.k8s import PolicyError, RenderOptions, render, write

    try:
        pipeline = load_spec(spec)
    except SpecError as e:
        _fail(str(e))
    opts = RenderOptions(
        namespace=namespace,
        engine=engine,
        gateway_replicas=gateway_replicas,
        agent_old_kernel=agent_old_kernel,
        autoscaler=autoscaler,
    )
    images = {
        "image": image,
        "agent_image": agent_image,
        "vllm_image": vllm_image,
        "prometheus_url": prometheus_url,
    }
    opts = replace(opts, **{k: v for k, v in images.items() if v})
    try:
        paths = write(render(pipeline, opts), out)
    except (PolicyError, ValueError) as e:
        _fail(str(e))
    keda = "; KEDA: keda/, once KEDA runs" if any(p.parent.name == "keda" for p in paths) else ""
    _console().print(
        f"wrote {len(paths)} object(s) to {out} (Prometheus Operator: monitoring/{keda})"
    )


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
        _fail("no key given")
    print(key_digest(key))


@app.command()
def ready(
    url: Annotated[str, typer.Option(help="Engine base URL.")] = "http://127.0.0.1:8000",
    budget_ms: Annotated[
        float, typer.Option(help="Stage 2: the warm-up completion must finish within this.")
    ] = 5000.0,
    model: Annotated[str | None, typer.Option(help="Model to warm [the first listed].")] = None,
) -> None:
    """Two-stage readiness of an engine (health, then a warm completion within budget)."""
    from unbroken.k8s.hooks import ready as check_ready

    ok, why = check_ready(url, budget_ms=budget_ms, model=model)
    _console().print(why)
    raise typer.Exit(0 if ok else 1)


def main() -> None:
    # Deep-copy protection: the engine's stdout may be a pipe nobody reads.
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    app()
