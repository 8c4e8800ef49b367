"""Weight files: generated shards, their safetensors layout checked strictly, and the staged
loader that reads every byte (checked against the safetensors library on the same files)."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from unbroken.engine.weights import (
    WeightError,
    WeightLoader,
    load_weights,
    make_weights,
    parse_size,
    read_header,
)


class Recorder:
    """A Device that records what it is given, from whichever thread calls it."""

    def __init__(self, fail_after: int | None = None) -> None:
        self.allocs: list[int] = []
        self.copies: list[int] = []
        self.threads: set[str] = set()
        self.fail_after = fail_after

    def alloc(self, nbytes: int) -> None:
        self.allocs.append(nbytes)

    def copy(self, nbytes: int) -> None:
        self.threads.add(threading.current_thread().name)
        if self.fail_after is not None and len(self.copies) >= self.fail_after:
            raise RuntimeError("device lost")
        self.copies.append(nbytes)


def reference_checksum(paths: list[Path]) -> int:
    """One byte per page of every tensor, read through the safetensors library."""
    total = 0
    for p in paths:
        with safe_open(str(p), framework="numpy") as f:
            for key in f.keys():
                raw = f.get_tensor(key).reshape(-1).view(np.uint8)
                total += int(raw[::4096].sum(dtype=np.uint64))
    return total & 0xFFFFFFFFFFFF


def test_parse_size() -> None:
    assert parse_size("1GiB") == 2**30
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("2G") == 2_000_000_000
    assert parse_size("1000") == 1000
    for bad in ("", "abc", "-1G", "5 parsecs", "0"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_make_and_load_every_byte(tmp_path: Path) -> None:
    paths = make_weights(tmp_path, 40 * 2**20, shard_bytes=16 * 2**20, tensor_bytes=4 * 2**20)
    assert len(paths) == 3
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 40 * 2**20
    with safe_open(str(paths[0]), framework="numpy") as f:
        assert all(k in index["weight_map"] for k in f.keys())
    dev = Recorder()
    # 1 MiB chunks: every 4 MiB tensor arrives in several pieces, through a 2-buffer ring.
    loader = WeightLoader(tmp_path, device=lambda: dev, readers=2, chunk=2**20, staging=2)
    report = loader.start().wait()
    assert report.files == 3 and report.tensors == 10
    assert report.bytes == 40 * 2**20 == sum(dev.copies) == sum(dev.allocs)
    assert dev.allocs == [4 * 2**20] * 10 and len(dev.copies) == 40
    assert dev.threads == {"weights-copy"}  # uploads never run on a reader thread
    assert report.checksum == reference_checksum(paths)
    # Another chunk size and reader count read the same bytes.
    assert load_weights(tmp_path).checksum == report.checksum
    again = WeightLoader(tmp_path, readers=1, chunk=3 * 4096).start().wait()
    assert (again.files, again.tensors, again.bytes, again.checksum) == (
        3,
        10,
        40 * 2**20,
        report.checksum,
    )


def test_no_read_copies_more_than_a_mebibyte_at_once(tmp_path: Path) -> None:
    """By default each preadv is at most 1 MiB: the kernel copies a read without being
    preempted (preempt=none kernels), so a bigger one holds every thread woken on that CPU
    for as long (16 MiB reads held a demo's SCHED_FIFO load generator 65 ms while a surge
    replica loaded its weights). Each piece the loader reads is one preadv."""
    make_weights(tmp_path, 24 * 2**20, shard_bytes=12 * 2**20, tensor_bytes=6 * 2**20)
    dev = Recorder()
    report = WeightLoader(tmp_path, device=lambda: dev).start().wait()
    assert report.bytes == 24 * 2**20 == sum(dev.copies)
    assert max(dev.copies) <= 2**20, max(dev.copies)


def test_load_time_ends_with_the_load_not_with_wait(tmp_path: Path) -> None:
    """The engine calls wait() after its imports: a load that finished earlier must not be
    reported as lasting until then."""
    make_weights(tmp_path, 4 * 2**20)
    loader = WeightLoader(tmp_path).start()
    time.sleep(1.0)  # 4 MiB from the page cache takes milliseconds
    report = loader.wait()
    assert report.bytes == 4 * 2**20 and 0 < report.seconds < 0.5


def test_header_agrees_with_safetensors(tmp_path: Path) -> None:
    [path] = make_weights(tmp_path, 3 * 2**20 + 6, tensor_bytes=2**20)
    tensors = read_header(path)
    data = path.read_bytes()
    with safe_open(str(path), framework="numpy") as f:
        assert {t.name for t in tensors} == set(f.keys()) and len(tensors) == 4
        for t in tensors:
            arr = f.get_tensor(t.name)
            assert t.dtype == "F16" and t.shape == arr.shape
            assert data[t.start : t.end] == arr.tobytes()


def _write(path: Path, header: object, data: bytes, *, length: int | None = None) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


@pytest.mark.parametrize(
    ("header", "data", "length", "message"),
    [
        (b"", b"", None, "header is not JSON"),
        (
            {"a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]}},
            b"\0" * 4,
            10**6,
            "past the end",
        ),
        (b"{not json", b"", None, "header is not JSON"),
        ([1, 2], b"", None, "not a JSON object"),
        ({"a": {"dtype": "F16", "shape": [2]}}, b"\0" * 4, None, "lacks dtype/shape/data_offsets"),
        (
            {"a": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 4]}},
            b"\0" * 4,
            None,
            "unknown dtype",
        ),
        (
            {"a": {"dtype": "F16", "shape": [-2], "data_offsets": [0, 4]}},
            b"\0" * 4,
            None,
            "bad shape",
        ),
        ({"a": {"dtype": "F16", "shape": [3], "data_offsets": [0, 4]}}, b"\0" * 4, None, "needs 6"),
        (
            {"a": {"dtype": "F16", "shape": [2], "data_offsets": [4, 0]}},
            b"\0" * 4,
            None,
            "bad data_offsets",
        ),
        (
            {
                "a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]},
                "b": {"dtype": "F16", "shape": [2], "data_offsets": [2, 6]},
            },
            b"\0" * 6,
            None,
            "overlaps",
        ),
        ({"a": {"dtype": "F16", "shape": [2], "data_offsets": [2, 6]}}, b"\0" * 6, None, "gap"),
        (
            {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}},
            b"\0" * 10,
            None,
            "truncated",
        ),
        ({"a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 9, None, "cover 4"),
    ],
)
def test_bad_files_are_named_and_explained(
    tmp_path: Path, header: object, data: bytes, length: int | None, message: str
) -> None:
    path = _write(tmp_path / "model.safetensors", header, data, length=length)
    with pytest.raises(WeightError, match=message) as e:
        WeightLoader(tmp_path).start()
    assert str(path) in str(e.value)


def test_short_file_and_missing_weights(tmp_path: Path) -> None:
    (tmp_path / "x.safetensors").write_bytes(b"abc")
    with pytest.raises(WeightError, match="too short"):
        read_header(tmp_path / "x.safetensors")
    with pytest.raises(WeightError, match=r"no \*\.safetensors files"):
        load_weights(tmp_path / "empty-dir-that-does-not-exist")


def test_device_failures_reach_the_caller(tmp_path: Path) -> None:
    make_weights(tmp_path, 8 * 2**20, tensor_bytes=2**20)

    def no_device() -> Recorder:
        raise OSError("libcudart.so: cannot open shared object file")

    with pytest.raises(OSError, match="cannot open"):
        WeightLoader(tmp_path, device=no_device, chunk=2**20, staging=2).start().wait()
    dev = Recorder(fail_after=3)
    with pytest.raises(RuntimeError, match="device lost"):
        WeightLoader(tmp_path, device=lambda: dev, chunk=2**20, staging=2).start().wait()
    assert len(dev.copies) == 3


def test_cli_weights_make(tmp_path: Path) -> None:
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


def test_engine_refuses_corrupt_weights_clearly(tmp_path: Path) -> None:
    [path] = make_weights(tmp_path, 2**20)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 100)
    r = subprocess.run(
        [sys.executable, "-m", "unbroken", "engine", "--port", "1", "--weights", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert "error:" in r.stderr and "truncated" in r.stderr and str(path) in r.stderr
    assert "Traceback" not in r.stderr


def test_engine_loads_weights_and_exports_timing(tmp_path: Path) -> None:
    from helpers import engine, metric

    make_weights(tmp_path / "w", 16 * 2**20)
    p = engine(tmp_path, "--weights", str(tmp_path / "w"))
    try:
        assert metric(p.url, "unbroken_engine_weights_bytes") == 16 * 2**20
        assert metric(p.url, "unbroken_engine_weights_load_seconds") > 0
        assert metric(p.url, "unbroken_engine_startup_seconds") > 0
        assert "weights: 1 files, 1 tensors" in p.tail()
    finally:
        p.stop()
