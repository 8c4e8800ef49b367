"""The simulator's command line in vLLM's own syntax: `python -m unbroken.engine ...`.

`--served-model-name` and `--lora-modules` take several values after one flag (vLLM's
`nargs="+"`), which typer cannot express; this argparse parser can. It takes every option of
`unbroken engine` too, so a supervisor can start the simulator with a vLLM-style argv.
`vllm_options` parses just the vLLM-only part, for a caller (the typer command) that has
parsed the rest itself.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from unbroken.engine.kvevents import KVEventsConfig, parse_kv_events_config
from unbroken.engine.lora import LoRAModule, parse_lora_modules

__all__ = ["add_vllm_args", "build_parser", "main", "vllm_options"]


def _origins(raw: str) -> list[str]:
    """vLLM's `--allowed-origins`: a JSON list (vLLM parses it with json.loads)."""
    try:
        v = json.loads(raw)
    except json.JSONDecodeError:
        v = None
    if not isinstance(v, list) or not all(isinstance(o, str) for o in v):
        raise argparse.ArgumentTypeError(f"a JSON list of origins, e.g. '[\"*\"]', not {raw!r}")
    return v


def add_vllm_args(p: argparse.ArgumentParser, *, names: bool = True) -> None:
    """vLLM's flags for names, LoRA, the step's token budget and CORS (vllm/entrypoints/
    openai/cli_args.py, launchers/cli_args.py, arg_utils)."""
    if names:
        p.add_argument(
            "--served-model-name",
            "--model",
            dest="served_model_name",
            nargs="+",
            default=["unbroken-sim"],
            metavar="NAME",
            help="Names served; the first is the one responses carry (default unbroken-sim).",
        )
    p.add_argument("--enable-lora", action="store_true", help="Serve LoRA adapters.")
    p.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        default=[],
        metavar="MODULE",
        help='Adapters: name=path, or JSON {"name", "path", "base_model_name"}.',
    )
    p.add_argument(
        "--max-loras", type=int, default=1, help="Distinct adapters in one batch (default 1)."
    )
    p.add_argument("--max-lora-rank", type=int, default=16, help="Accepted for vLLM compatibility.")
    p.add_argument(
        "--kv-events-config",
        default=None,
        metavar="JSON",
        help='KV cache events as vLLM publishes them, e.g. \'{"enable_kv_cache_events": true, '
        '"publisher": "zmq", "endpoint": "tcp://*:5557"}\' (docs/engine.md).',
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="Tokens one step may compute; longer prefills are chunked (profile: 8192).",
    )
    p.add_argument(
        "--allowed-origins",
        type=_origins,
        default=[],
        metavar="JSON",
        help="CORS origins, e.g. '[\"*\"]'; vLLM 0.32's default []: cross-origin browser "
        "access is disabled.",
    )


def _kv_events(ns: argparse.Namespace) -> KVEventsConfig | None:
    """ValueError (one line) for a config vLLM would refuse."""
    return None if ns.kv_events_config is None else parse_kv_events_config(ns.kv_events_config)


def _lora_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    """ValueError (one line for the command line) for what vLLM refuses at start."""
    mods: list[LoRAModule] = parse_lora_modules(ns.lora_modules)
    if mods and not ns.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    if ns.max_loras < 1 or ns.max_lora_rank < 1:
        raise ValueError("--max-loras and --max-lora-rank must be at least 1")
    if len({m.name for m in mods}) != len(mods):
        raise ValueError("--lora-modules: an adapter name appears twice")
    return {
        "enable_lora": ns.enable_lora,
        "lora_modules": tuple(mods),
        "max_loras": ns.max_loras,
        "max_lora_rank": ns.max_lora_rank,
    }


def vllm_options(extra: Sequence[str]) -> dict[str, Any]:
    """EngineConfig keyword arguments from what another parser left over: further served
    names (the values after the first of `--served-model-name A B`), `--enable-lora`,
    `--lora-modules ...`, `--max-loras N`, `--max-lora-rank N`, `--max-num-batched-tokens N`
    (applied to the profile by EngineConfig), `--kv-events-config JSON`, `--allowed-origins
    JSON`. ValueError on anything else."""
    p = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    p.add_argument("aliases", nargs="*")
    add_vllm_args(p, names=False)
    try:
        ns, rest = p.parse_known_args(list(extra))
    except argparse.ArgumentError as e:
        raise ValueError(str(e)) from None
    if rest:
        raise ValueError(f"unknown option(s): {' '.join(rest)}")
    if ns.max_num_batched_tokens is not None and ns.max_num_batched_tokens < 1:
        raise ValueError("--max-num-batched-tokens must be at least 1")
    return {
        "aliases": tuple(ns.aliases),
        "kv_events": _kv_events(ns),
        "max_num_batched_tokens": ns.max_num_batched_tokens,
        "allowed_origins": tuple(ns.allowed_origins),
        **_lora_kwargs(ns),
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m unbroken.engine",
        description="The vLLM-compatible engine simulator (vLLM's flag syntax).",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    add_vllm_args(p)
    p.add_argument("--profile", default="fp16", help="Timing profile: fp16 or fp8.")
    p.add_argument("--weights", type=Path, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eos-rate", type=float, default=0.0)
    for name, kind in (
        ("max-num-seqs", int),
        ("kv-capacity-tokens", int),
        ("max-model-len", int),
        ("prefill-per-token-s", float),
        ("decode-base-s", float),
        ("decode-per-seq-s", float),
        ("block-size", int),
    ):
        p.add_argument(f"--{name}", type=kind, default=None, help="Override the profile.")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--shutdown-timeout", type=float, default=30.0)
    p.add_argument("--admin-token", default=os.environ.get("UNBROKEN_ADMIN_TOKEN"))
    p.add_argument("--no-cuda-stub", action="store_true")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    p = build_parser()
    ns = p.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if ns.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    from unbroken.engine.profiles import get_profile

    try:
        prof = get_profile(
            ns.profile,
            max_num_seqs=ns.max_num_seqs,
            kv_capacity_tokens=ns.kv_capacity_tokens,
            max_model_len=ns.max_model_len,
            prefill_per_token_s=ns.prefill_per_token_s,
            decode_base_s=ns.decode_base_s,
            decode_per_seq_s=ns.decode_per_seq_s,
            block_size=ns.block_size,
            max_num_batched_tokens=ns.max_num_batched_tokens,
            enable_prefix_caching=ns.enable_prefix_caching,
        )
        lora = _lora_kwargs(ns)
        kv_events = _kv_events(ns)
    except ValueError as e:
        p.error(str(e))
    if ns.weights is not None and not ns.weights.exists():
        p.error(f"weights path {ns.weights} does not exist")
    loader = None
    if ns.weights is not None:
        from unbroken.engine.weights import WeightError, start_weights

        try:
            loader = start_weights(ns.weights, upload=not ns.no_cuda_stub)
        except (WeightError, OSError) as e:
            p.error(str(e))
    from unbroken.engine.server import EngineConfig, run_engine

    first, *aliases = ns.served_model_name
    cfg = EngineConfig(
        host=ns.host,
        port=ns.port,
        model_name=first,
        aliases=tuple(aliases),
        profile=prof,
        seed=ns.seed,
        eos_rate=ns.eos_rate,
        weights=ns.weights,
        weights_loader=loader,
        admin_token=ns.admin_token or None,
        shutdown_timeout=ns.shutdown_timeout,
        use_cuda_stub=not ns.no_cuda_stub,
        kv_events=kv_events,
        allowed_origins=tuple(ns.allowed_origins),
        **lora,
    )
    try:
        cfg.validate()
    except ValueError as e:
        p.error(str(e))
    run_engine(cfg)
