"""Fixtures of the real-vLLM tier (see vllmstack.py)."""

from vllmstack import model_dirs, stack_canonical, stack_random, vllm_venv

__all__ = ["model_dirs", "stack_canonical", "stack_random", "vllm_venv"]
