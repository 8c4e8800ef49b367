"""LoRA adapters and served model names, as vLLM's OpenAI server handles them.

vLLM (vllm/entrypoints/openai/serving_models.py, cli_args.py):

- `--served-model-name A B ...`: every name is accepted in requests; the first is the name
  responses and the metrics' `model_name` carry. `/v1/models` lists one card per name.
- `--enable-lora --lora-modules ...`: each module is `name=path` or a JSON object
  `{"name": ..., "path": ..., "base_model_name": ...}`. A request names an adapter in its
  `model`; its response's `model` is the adapter's name. `/v1/models` lists each adapter with
  `root` = its path and `parent` = its base (the first served name unless the module names
  another served name).
- `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` adds `POST /v1/load_lora_adapter`
  (`{"lora_name", "lora_path"}`) and `POST /v1/unload_lora_adapter` (`{"lora_name"}`): 200
  with a plain-text "Success: ..." line, 400 `InvalidUserInput` (missing field, already
  loaded), 404 `NotFoundError` (unloading an unknown adapter). Without the variable the
  routes do not exist (404).
- `--max-loras N` (default 1): at most N distinct adapters run in one batch; requests of
  another adapter wait (vllm/v1/core/sched/scheduler.py skips them, keeping their place).

The simulator reads no adapter files: an adapter is its name, which keys its text
(`textmodel.model_key`), so a misrouted request is visible byte for byte.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "LoRAModule",
    "LoRARegistry",
    "LoadedAdapter",
    "parse_lora_modules",
    "runtime_lora_updating",
]

RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_lora_updating() -> bool:
    """vLLM's envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING: "1" or "true", any case."""
    return os.environ.get(RUNTIME_ENV, "0").strip().lower() in ("1", "true")


@dataclass(frozen=True, slots=True)
class LoRAModule:
    """One `--lora-modules` entry (vLLM's LoRAModulePath)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(values: Iterable[str]) -> list[LoRAModule]:
    """vLLM's LoRAParserAction: `name=path` when the item has '=' and no ',', else a JSON
    object with `name`, `path` and optionally `base_model_name`. ValueError on anything else."""
    out: list[LoRAModule] = []
    for item in values:
        if not item:
            continue
        if "=" in item and "," not in item:
            name, _, path = item.partition("=")
            if not name or not path or "=" in path:
                raise ValueError(f"Invalid format for --lora-modules: {item}")
            out.append(LoRAModule(name, path))
            continue
        try:
            d = json.loads(item)
        except json.JSONDecodeError:
            raise ValueError(f"Invalid JSON format for --lora-modules: {item}") from None
        if not isinstance(d, dict):
            raise ValueError(f"Invalid JSON format for --lora-modules: {item}")
        try:
            mod = LoRAModule(**d)
        except TypeError as e:
            raise ValueError(f"Invalid fields for --lora-modules: {item} - {e}") from None
        if not isinstance(mod.name, str) or not isinstance(mod.path, str):
            raise ValueError(f"Invalid fields for --lora-modules: {item}")
        if not mod.name or not mod.path:
            raise ValueError(f"Invalid fields for --lora-modules: {item}")
        out.append(mod)
    return out


@dataclass(frozen=True, slots=True)
class LoadedAdapter:
    name: str
    int_id: int
    path: str
    base_model_name: str  # its `parent` in /v1/models


class LoRARegistry:
    """The adapters an engine serves now, in load order (vLLM's lora_requests)."""

    def __init__(self, base_names: Iterable[str]) -> None:
        self.base_names = list(base_names)
        self.adapters: dict[str, LoadedAdapter] = {}
        self._ids = itertools.count(1)

    def load(self, name: str, path: str, base_model_name: str | None = None) -> LoadedAdapter:
        """Add (or, for a name already loaded, replace: vLLM's load_inplace) an adapter."""
        base = base_model_name if base_model_name in self.base_names else self.base_names[0]
        prev = self.adapters.get(name)
        a = LoadedAdapter(name, prev.int_id if prev else next(self._ids), path, base)
        self.adapters[name] = a
        return a

    def unload(self, name: str) -> LoadedAdapter | None:
        return self.adapters.pop(name, None)

    def get(self, name: str) -> LoadedAdapter | None:
        return self.adapters.get(name)
