"""`unbroken engine`: the vLLM-compatible simulator's options, handed to
`engine.server.run_engine` (weights start loading before the server's imports)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from unbroken.cli.common import app, bind_error, fail, setup_logging


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
    name=path...`, `--max-loras N`, `--max-lora-rank N`, `--max-num-batched-tokens N`,
    `--kv-events-config JSON`, `--allowed-origins JSON` (CORS; default [], as vLLM 0.32:
    no cross-origin browser access)."""
    from unbroken.engine.cli_args import vllm_options
    from unbroken.engine.profiles import get_profile

    setup_logging(verbose)
    try:
        vllm = vllm_options(ctx.args)
    except ValueError as e:
        fail(str(e))
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
        fail(str(e))
    if weights is not None and not weights.exists():
        fail(f"weights path {weights} does not exist")
    loader = None
    if weights is not None:
        # Start reading weights before the server's imports, which then overlap the read.
        from unbroken.engine.weights import WeightError, start_weights

        try:
            loader = start_weights(weights, upload=not no_cuda_stub)
        except (WeightError, OSError) as e:
            fail(str(e))
    from unbroken.engine.server import EngineConfig, run_engine

    try:
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
    except OSError as e:  # the port in use: one line, as the gateway, controller and agent
        if (msg := bind_error(e, "--port")) is None:
            raise
        fail(msg)
