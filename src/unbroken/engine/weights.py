"""Weight files: generate Hugging Face style safetensors shards of random data, and load them
the way an engine does (every byte read through safetensors, then copied to the "device").
A cold page cache therefore costs what the disk costs."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

__all__ = ["LoadReport", "load_weights", "make_weights", "parse_size", "weight_files"]

Progress = Callable[[int], None]  # called with bytes just done

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "m": 1e6,
    "mb": 1e6,
    "g": 1e9,
    "gb": 1e9,
    "t": 1e12,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(text: str) -> int:
    """'1GiB', '512MiB', '2G', '1000000' → bytes."""
    s = text.strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num) :]
    if unit not in _UNITS or not num:
        raise ValueError(f"cannot parse size {text!r} (examples: 512MiB, 1GiB, 2G)")
    value = float(num) * _UNITS[unit]
    if value <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return int(value)


def weight_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(path.glob("*.safetensors"))


def make_weights(
    directory: Path,
    total_bytes: int,
    *,
    shard_bytes: int = 256 * 2**20,
    tensor_bytes: int = 16 * 2**20,
    seed: int = 0,
    progress: Progress | None = None,
) -> list[Path]:
    """Write `total_bytes` of float16 tensors as model-0000i-of-0000n.safetensors shards plus
    the index file. Returns the shard paths."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    n_shards = max(1, -(-total_bytes // shard_bytes))
    paths: list[Path] = []
    weight_map: dict[str, str] = {}
    remaining = total_bytes
    layer = 0
    for i in range(n_shards):
        name = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        budget = min(shard_bytes, remaining)
        tensors: dict[str, np.ndarray] = {}
        while budget > 0:
            nbytes = min(tensor_bytes, budget)
            elems = max(1, nbytes // 2)
            cols = 1024 if elems % 1024 == 0 else 1
            arr = np.frombuffer(rng.bytes(elems * 2), dtype=np.float16).reshape(-1, cols)
            key = f"model.layers.{layer}.weight"
            tensors[key] = arr
            weight_map[key] = name
            layer += 1
            budget -= elems * 2
            remaining -= elems * 2
        tmp = directory / (name + ".tmp")
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, directory / name)
        paths.append(directory / name)
        if progress:
            progress(sum(a.nbytes for a in tensors.values()))
    index = {"metadata": {"total_size": total_bytes - max(remaining, 0)}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return paths


@dataclass(frozen=True, slots=True)
class LoadReport:
    files: int
    bytes: int
    seconds: float
    checksum: int

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def load_weights(
    path: Path,
    *,
    to_device: Callable[[int], None] | None = None,
    progress: Progress | None = None,
) -> LoadReport:
    """Read every tensor of every shard through safetensors (every byte copied out of the
    page cache), fold it into a checksum, and hand its size to `to_device` (the stand-in
    cudaMalloc + cudaMemcpyAsync)."""
    files = weight_files(path)
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    t0 = time.perf_counter()
    total = 0
    checksum = 0
    for f in files:
        with safe_open(str(f), framework="numpy") as st:
            for key in st.keys():
                arr = st.get_tensor(key)
                raw = arr.reshape(-1).view(np.uint8)
                # One byte per page into the checksum: the copy above already read every byte.
                checksum = (checksum + int(raw[::4096].sum(dtype=np.uint64))) & 0xFFFFFFFFFFFF
                total += raw.nbytes
                if to_device:
                    to_device(raw.nbytes)
                if progress:
                    progress(raw.nbytes)
                del arr, raw
    return LoadReport(len(files), total, time.perf_counter() - t0, checksum)
