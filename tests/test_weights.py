"""Weight files: generated shards load through safetensors, every byte counted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from unbroken.engine.weights import load_weights, make_weights, parse_size


def test_parse_size() -> None:
    assert parse_size("1GiB") == 2**30
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("2G") == 2_000_000_000
    assert parse_size("1000") == 1000
    for bad in ("", "abc", "-1G", "5 parsecs", "0"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_make_and_load_roundtrip(tmp_path: Path) -> None:
    paths = make_weights(tmp_path, 40 * 2**20, shard_bytes=16 * 2**20, tensor_bytes=4 * 2**20)
    assert len(paths) == 3
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 40 * 2**20
    with safe_open(str(paths[0]), framework="numpy") as f:
        assert all(k in index["weight_map"] for k in f.keys())
    seen: list[int] = []
    report = load_weights(tmp_path, to_device=seen.append)
    assert report.bytes == 40 * 2**20 == sum(seen) and report.files == 3
    assert report.checksum == load_weights(tmp_path).checksum  # same data, same sum


def test_cli_weights_make_and_engine_reports_load(tmp_path: Path) -> None:
    d = tmp_path / "w"
    r = subprocess.run(
        [sys.executable, "-m", "unbroken", "weights", "make", str(d), "--size", "8MiB"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and "wrote 1 shard" in r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "unbroken", "weights", "make", str(d), "--size", "lots"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "cannot parse size" in r.stderr
    with pytest.raises(FileNotFoundError):
        load_weights(tmp_path / "empty-dir-that-does-not-exist")


def test_engine_loads_weights_and_exports_timing(tmp_path: Path) -> None:
    from helpers import engine, metric

    make_weights(tmp_path / "w", 16 * 2**20)
    p = engine(tmp_path, "--weights", str(tmp_path / "w"))
    try:
        assert metric(p.url, "unbroken_engine_weights_bytes") == 16 * 2**20
        assert metric(p.url, "unbroken_engine_weights_load_seconds") > 0
        assert metric(p.url, "unbroken_engine_startup_seconds") > 0
        assert "weights: 1 files" in p.tail()
    finally:
        p.stop()
