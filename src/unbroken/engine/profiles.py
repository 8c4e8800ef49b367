"""Timing profiles of the simulated engine. A step costs
``decode_base_s + decode_per_seq_s * scheduled + prefill_per_token_s * prefill_tokens``, where
`scheduled` is the sequences the step computes tokens for and prefill tokens are the prompt
tokens (not held by the prefix cache) it computes: at most `max_num_batched_tokens` tokens a
step, a longer prefill going on in the next steps (vLLM v1's chunked prefill).

The proportions are a GPU's: an 8B-class model in 16 bits prefills at tens of microseconds a
token (16 GFLOP a token; an H100's 989 TFLOPS at 40 % is 40 us) and takes 10-30 ms a decode
step (every weight read once a step, plus attention over the running contexts), so a step's
fixed cost is worth a few hundred prefilled tokens. `max_num_batched_tokens`: vLLM's default
for its API server on a GPU with at least 70 GiB (8,192; 2,048 on smaller GPUs and A100s,
vllm/engine/arg_utils.py get_batch_defaults)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

__all__ = ["PROFILES", "EngineProfile", "get_profile"]


@dataclass(frozen=True, slots=True)
class EngineProfile:
    name: str
    max_num_seqs: int = 256
    kv_capacity_tokens: int = 65_536
    max_model_len: int = 16_384
    prefill_per_token_s: float = 40e-6
    decode_base_s: float = 0.020
    decode_per_seq_s: float = 0.000_15
    kernels_per_step: int = 8  # launches in a prefill step; decode steps replay one CUDA graph
    launch_overhead_s: float = 4e-6
    block_size: int = 16  # tokens per KV-cache block (vLLM's --block-size)
    max_num_batched_tokens: int = 8192  # tokens one step may compute (chunked prefill)
    enable_prefix_caching: bool = True  # vLLM v1's default

    @property
    def num_blocks(self) -> int:
        """KV-cache blocks: the capacity in tokens, in whole blocks (at least one)."""
        return max(1, self.kv_capacity_tokens // self.block_size)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be at least 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1")

    def step_time(self, scheduled: int, prefill_tokens: int) -> float:
        return (
            self.decode_base_s
            + self.decode_per_seq_s * scheduled
            + self.prefill_per_token_s * prefill_tokens
        )

    def with_overrides(self, **overrides: Any) -> EngineProfile:
        known = {f.name for f in fields(self)}
        bad = set(overrides) - known
        if bad:
            raise ValueError(f"unknown profile parameter(s): {', '.join(sorted(bad))}")
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


PROFILES: dict[str, EngineProfile] = {
    # fp8: faster steps and about twice the KV cache of fp16 (half the bytes per element).
    "fp16": EngineProfile("fp16"),
    "fp8": EngineProfile(
        "fp8",
        kv_capacity_tokens=131_072,
        prefill_per_token_s=25e-6,
        decode_base_s=0.013,
        decode_per_seq_s=0.000_10,
    ),
}


def get_profile(name: str, **overrides: Any) -> EngineProfile:
    try:
        base = PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; choose one of {', '.join(PROFILES)}") from None
    return base.with_overrides(**overrides)
