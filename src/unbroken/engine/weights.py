"""Weight files: generate Hugging Face style safetensors shards of random data, and load them
the way a fast engine loader does.

Loading streams every shard through a small ring of reusable staging buffers (the stand-in
for pinned host memory): reader threads `preadv` chunks into free buffers (the kernel copies
every byte out of the page cache, or from the disk when the cache is cold, with the GIL
released), and one copy thread hands each filled buffer to the device (a `cudaMemcpyAsync`
charged at PCIe speed) and returns it to the ring, so reading and device copies overlap and
memory held stays `staging x chunk` whatever the model's size. The loader imports only the
standard library and starts before the engine's heavy imports, so the read overlaps them too.

The safetensors layout is parsed here (8-byte little-endian header length, JSON header,
data), checked strictly: every tensor's byte range must match its dtype and shape, and the
ranges must tile the data section exactly.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from unbroken.engine import cuda

__all__ = [
    "Device",
    "LoadReport",
    "TensorInfo",
    "WeightError",
    "WeightLoader",
    "load_weights",
    "make_weights",
    "parse_size",
    "read_header",
    "start_weights",
    "weight_files",
]

log = logging.getLogger(__name__)

Progress = Callable[[int], None]  # called with bytes just done

# Per preadv. The kernel copies a page-cache read in one go and, built with preempt=none as
# this VM's is (and most server kernels), does not preempt it: every thread woken on that
# CPU meanwhile waits, the demo's SCHED_FIFO load generator and the serving engines
# included, whatever the reader's nice, SCHED_IDLE or CPU quota. 16 MiB per call held a
# traced demo's load generator off its CPU for 65 ms while a surge replica loaded (a FIFO
# probe pinned beside the loader here: 9.7 ms worst at 16 MiB, 0.9 ms at 1 MiB, the load
# as fast). Small enough too that the one-byte-per-page checksum hits cache.
CHUNK = 2**20
PAGE = 4096
MAX_HEADER = 100 * 2**20  # the safetensors reference implementation's own limit

DTYPE_SIZES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


class WeightError(ValueError):
    """A weight file that is not valid safetensors, or a path with none."""


class Device(Protocol):
    """Where loaded bytes go: `alloc` once per tensor, `copy` once per staged chunk."""

    def alloc(self, nbytes: int) -> None: ...

    def copy(self, nbytes: int) -> None: ...


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
    import numpy as np  # here, not at the top: the engine's load path must stay light
    from safetensors.numpy import save_file

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
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute file offsets
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_header(path: Path, fd: int | None = None) -> list[TensorInfo]:
    """The tensors of one safetensors file in file order; WeightError when the layout is
    not valid (bad header, unknown dtype, sizes that disagree, gaps, overlaps, truncation).
    Reads through `fd` when the caller already has the file open."""
    if fd is None:
        with open(path, "rb") as f:
            return read_header(path, f.fileno())
    size = os.fstat(fd).st_size
    raw = os.pread(fd, 8, 0)
    if len(raw) < 8:
        raise WeightError(f"{path}: too short to be safetensors ({size} bytes)")
    n = int.from_bytes(raw, "little")
    if n > MAX_HEADER or n > size - 8:
        raise WeightError(f"{path}: header length {n} is past the end of a {size}-byte file")
    try:
        header = json.loads(os.pread(fd, n, 8))
    except (UnicodeDecodeError, ValueError) as e:
        raise WeightError(f"{path}: header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise WeightError(f"{path}: header is not a JSON object")
    base = 8 + n
    tensors: list[TensorInfo] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (b, e) = entry["dtype"], entry["shape"], entry["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise WeightError(f"{path}: tensor {name!r} lacks dtype/shape/data_offsets") from None
        if dtype not in DTYPE_SIZES:
            raise WeightError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise WeightError(f"{path}: tensor {name!r} has a bad shape {shape!r}")
        if not all(isinstance(x, int) for x in (b, e)) or not 0 <= b <= e:
            raise WeightError(f"{path}: tensor {name!r} has bad data_offsets {[b, e]!r}")
        elems = 1
        for d in shape:
            elems *= d
        if e - b != elems * DTYPE_SIZES[dtype]:
            raise WeightError(
                f"{path}: tensor {name!r} is {e - b} bytes, but {dtype}{shape} needs "
                f"{elems * DTYPE_SIZES[dtype]}"
            )
        tensors.append(TensorInfo(name, dtype, tuple(shape), base + b, base + e))
    tensors.sort(key=lambda t: t.start)
    at = base
    for t in tensors:
        if t.start != at:
            what = "overlaps the one before" if t.start < at else "leaves a gap before it"
            raise WeightError(f"{path}: tensor {t.name!r} {what}")
        at = t.end
    if at != size:
        raise WeightError(
            f"{path}: data section is {size - base} bytes but the tensors cover {at - base}"
            + (" (file truncated?)" if at > size else "")
        )
    return tensors


@dataclass(frozen=True, slots=True)
class LoadReport:
    files: int
    tensors: int
    bytes: int
    seconds: float
    checksum: int

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(frozen=True, slots=True)
class _Piece:
    fd: int
    offset: int
    nbytes: int
    tensor_bytes: int  # > 0 on a tensor's first piece: allocate it on the device first


@dataclass(slots=True)
class _Staged:
    buf: mmap.mmap
    piece: _Piece
    checksum: int


class WeightLoader:
    """Load a weight directory (or one file) through a ring of staging buffers.

    `start()` parses every header (errors raise there, before any thread starts) and starts
    the threads; `wait()` returns the LoadReport or raises what a thread hit. `device` is
    called on the copy thread to make the Device, so building or loading a CUDA library
    also happens off the caller's thread; None means no device (bytes are only read).
    """

    def __init__(
        self,
        path: Path,
        *,
        device: Callable[[], Device | None] | None = None,
        readers: int | None = None,
        chunk: int = CHUNK,
        staging: int | None = None,
        progress: Progress | None = None,
    ) -> None:
        if chunk <= 0 or chunk % PAGE:
            raise ValueError(f"chunk must be a positive multiple of {PAGE}, got {chunk}")
        self.path = path
        # One core less than the machine has, 1 to 4: a replica starting beside serving
        # ones (a rollout's surge) must leave them a core. With 2 readers on 2 cores, the
        # demo's first surge replica read its pre-warmed 1 GiB in 0.6-0.7 s and every engine
        # on the host stalled 60-150 ms meanwhile (the rollout's p99.9 TTFT 1.6-2.1x steady in
        # 4 runs of 4); with 1 reader the same read took 0.72 s and the rollout's p99.9 was
        # 1.32x steady. One reader with the kernel's readahead still saturates a VM disk; more
        # help NVMe queue depth on larger machines.
        self.readers = readers or max(1, min(4, (os.cpu_count() or 2) - 1))
        self.staging = staging or 2 * self.readers
        self.chunk = chunk
        self._device_factory = device
        self._progress = progress
        self._fds: list[int] = []
        self._pieces: Iterator[_Piece] = iter(())
        self._lock = threading.Lock()
        self._free: queue.Queue[mmap.mmap] = queue.Queue()
        self._filled: queue.Queue[_Staged | None] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._error: BaseException | None = None
        self._t0 = self._t1 = 0.0
        self._files = self._tensors = self._bytes = 0
        self._checksum = 0
        self._report: LoadReport | None = None

    def start(self) -> WeightLoader:
        files = weight_files(self.path)
        if not files:
            raise WeightError(f"no *.safetensors files in {self.path}")
        self._t0 = time.perf_counter()
        plan: list[_Piece] = []
        try:
            for f in files:
                fd = os.open(f, os.O_RDONLY)
                self._fds.append(fd)
                tensors = read_header(f, fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                for t in tensors:
                    for off in range(t.start, t.end, self.chunk):
                        first = t.nbytes if off == t.start else 0
                        plan.append(_Piece(fd, off, min(self.chunk, t.end - off), first))
                self._tensors += len(tensors)
        except BaseException:
            self._close()
            raise
        self._files = len(files)
        self._pieces = iter(plan)
        for _ in range(self.staging):
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
            self._free.put(mmap.mmap(-1, self.chunk, flags=flags))
        self._threads = [
            threading.Thread(target=self._read, name=f"weights-read-{i}", daemon=True)
            for i in range(self.readers)
        ]
        self._threads.append(threading.Thread(target=self._copy, name="weights-copy", daemon=True))
        for t in self._threads:
            t.start()
        return self

    def wait(self) -> LoadReport:
        if self._report is None:
            for t in self._threads:
                t.join()
            self._close()
            if self._error is not None:
                raise self._error
            self._report = LoadReport(
                self._files,
                self._tensors,
                self._bytes,
                self._t1 - self._t0,  # the copy thread's end, not when someone asked
                self._checksum,
            )
        return self._report

    def _fail(self, e: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = e
            self._pieces = iter(())

    def _read(self) -> None:
        try:
            while True:
                with self._lock:
                    piece = next(self._pieces, None)
                if piece is None:
                    return
                buf = self._free.get()
                try:
                    checksum = self._fill(buf, piece)
                except BaseException:
                    self._free.put(buf)
                    raise
                self._filled.put(_Staged(buf, piece, checksum))
        except BaseException as e:
            self._fail(e)
        finally:
            self._filled.put(None)  # one end marker per reader

    def _fill(self, buf: mmap.mmap, piece: _Piece) -> int:
        with memoryview(buf) as view:
            done = 0
            while done < piece.nbytes:
                got = os.preadv(piece.fd, [view[done : piece.nbytes]], piece.offset + done)
                if got == 0:
                    raise WeightError(f"{self.path}: a file shrank while loading")
                done += got
            # One byte per page: the copy above already brought every byte in.
            return sum(view[0 : piece.nbytes : PAGE])

    def _copy(self) -> None:
        device: Device | None = None
        try:
            device = self._device_factory() if self._device_factory else None
        except BaseException as e:
            self._fail(e)
        ended = 0
        while ended < self.readers:
            staged = self._filled.get()
            if staged is None:
                ended += 1
                continue
            piece = staged.piece
            try:
                if device is not None and self._error is None:
                    if piece.tensor_bytes:
                        device.alloc(piece.tensor_bytes)
                    device.copy(piece.nbytes)
                self._bytes += piece.nbytes
                self._checksum = (self._checksum + staged.checksum) & 0xFFFFFFFFFFFF
                if self._progress:
                    self._progress(piece.nbytes)
            except BaseException as e:
                self._fail(e)
            finally:
                self._free.put(staged.buf)
        self._t1 = time.perf_counter()

    def _close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
        while not self._free.empty():
            self._free.get_nowait().close()


def load_weights(
    path: Path,
    *,
    device: Callable[[], Device | None] | None = None,
    progress: Progress | None = None,
) -> LoadReport:
    """Load and wait: `WeightLoader(path, ...).start().wait()`."""
    return WeightLoader(path, device=device, progress=progress).start().wait()


def start_weights(path: Path, upload: bool = True) -> WeightLoader:
    """Start an engine's weight load: uploads go through the stand-in CUDA library unless
    `upload` is False (the engine then times its steps in pure Python)."""
    return WeightLoader(path, device=cuda.weight_upload if upload else None).start()
