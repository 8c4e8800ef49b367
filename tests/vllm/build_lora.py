"""Build a LoRA adapter for the tiny Llama of build_model.py, in PEFT's layout (what
`vllm serve --enable-lora --lora-modules NAME=PATH` and `/v1/load_lora_adapter` read), with
random weights large enough to change the model's greedy output. Nothing is downloaded. Run
with the vLLM venv's Python:

    python build_lora.py OUT_DIR SEED BASE_MODEL_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RANK = 8


def main(out: str, seed: int, base: str) -> None:
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((Path(base) / "config.json").read_text())
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        for m in ("q_proj", "v_proj"):
            p = f"base_model.model.model.layers.{i}.self_attn.{m}"
            tensors[f"{p}.lora_A.weight"] = torch.randn(RANK, hidden, generator=g) * 0.5
            tensors[f"{p}.lora_B.weight"] = torch.randn(hidden, RANK, generator=g) * 0.5
    dest = Path(out)
    dest.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(dest / "adapter_model.safetensors")
    )
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": RANK,
        "lora_alpha": 2 * RANK,
        "lora_dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"],
        "bias": "none",
        "base_model_name_or_path": base,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }
    (dest / "adapter_config.json").write_text(json.dumps(config, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
