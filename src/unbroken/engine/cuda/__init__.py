"""The stand-in CUDA libraries: built from the C sources beside this file with the system C
compiler, cached by source hash, and called through ctypes from the engine's step thread
(ctypes releases the GIL during the call, as a real CUDA call would let other threads run).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

__all__ = [
    "PCIE_BYTES_PER_S",
    "CudaStub",
    "Fn",
    "StubBuildError",
    "WeightUpload",
    "build",
    "load",
    "stub_dir",
    "weight_upload",
]

log = logging.getLogger(__name__)

_SRC = Path(__file__).parent
PCIE_BYTES_PER_S = 25e9  # host-to-device rate charged for weight uploads (PCIe 4.0 x16)
DRIVER_SONAME = "libunbroken_cuda.so.1"
RUNTIME_SONAME = "libunbroken_cudart.so.12"
# Frame pointers and no CET: entry points begin with `push %rbp` as in libcudart/libcuda;
# no sibling calls, so a runtime call really nests its driver call.
CFLAGS = [
    "-O2",
    "-fPIC",
    "-shared",
    "-g",
    "-fno-omit-frame-pointer",
    "-fcf-protection=none",
    "-fno-optimize-sibling-calls",
    "-fvisibility=hidden",
    "-Wall",
    "-Werror",
]


class Fn(IntEnum):
    CU_LAUNCH_KERNEL = 0
    CU_LAUNCH_KERNEL_EX = 1
    CU_GRAPH_LAUNCH = 2
    CU_MEM_ALLOC = 3
    CU_MEMCPY_HTOD_ASYNC = 4
    CU_MEMCPY_DTOH_ASYNC = 5
    CU_STREAM_SYNCHRONIZE = 6


class StubBuildError(RuntimeError):
    pass


def _sources_hash() -> str:
    h = hashlib.sha256()
    for name in ("ubcuda.h", "ubcuda_driver.c", "ubcuda_runtime.c"):
        h.update((_SRC / name).read_bytes())
    h.update(" ".join(CFLAGS).encode())
    return h.hexdigest()[:16]


def stub_dir() -> Path:
    base = Path(os.environ.get("UNBROKEN_CACHE_DIR", Path.home() / ".cache" / "unbroken"))
    return base / "cuda" / _sources_hash()


def build(dest: Path | None = None) -> Path:
    """Build both libraries into `dest` (default: the cache); return the directory. Atomic,
    so engines starting together never load a half-written library."""
    dest = dest or stub_dir()
    if (dest / RUNTIME_SONAME).exists() and (dest / DRIVER_SONAME).exists():
        return dest
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise StubBuildError("no C compiler found (install gcc or clang)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=dest.parent))
    try:
        cmds = [
            [
                cc,
                *CFLAGS,
                f"-Wl,-soname,{DRIVER_SONAME}",
                "-o",
                str(tmp / DRIVER_SONAME),
                str(_SRC / "ubcuda_driver.c"),
            ],
            [
                cc,
                *CFLAGS,
                f"-Wl,-soname,{RUNTIME_SONAME}",
                "-o",
                str(tmp / RUNTIME_SONAME),
                str(_SRC / "ubcuda_runtime.c"),
                str(tmp / DRIVER_SONAME),
                "-Wl,-rpath,$ORIGIN",
            ],
        ]
        for cmd in cmds:
            r = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if r.returncode != 0:
                raise StubBuildError(f"{' '.join(cmd)} failed:\n{r.stderr.strip()}")
        try:
            tmp.rename(dest)
        except OSError:  # another process won the race; theirs is identical
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


class _Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]


@dataclass
class CudaStub:
    runtime: ctypes.CDLL
    driver: ctypes.CDLL
    directory: Path

    def __post_init__(self) -> None:
        vp, sz, u = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint
        d, r = self.driver, self.runtime
        d.ubcuda_set_delay.argtypes = [ctypes.c_int, ctypes.c_longlong]
        d.ubcuda_set_contention.argtypes = [ctypes.c_longlong]
        d.ubcuda_calls.argtypes = [ctypes.c_int]
        d.ubcuda_calls.restype = ctypes.c_ulonglong
        d.cuLaunchKernel.argtypes = [vp, u, u, u, u, u, u, u, vp, vp, vp]
        d.cuStreamSynchronize.argtypes = [vp]
        r.cudaLaunchKernel.argtypes = [vp, _Dim3, _Dim3, vp, sz, vp]
        r.cudaGraphLaunch.argtypes = [vp, vp]
        r.cudaMalloc.argtypes = [ctypes.POINTER(vp), sz]
        r.cudaMemcpyAsync.argtypes = [vp, vp, sz, ctypes.c_int, vp]
        r.cudaStreamSynchronize.argtypes = [vp]
        self._grid = _Dim3(128, 1, 1)
        self._block = _Dim3(256, 1, 1)
        self._host = ctypes.create_string_buffer(4096)

    def set_delay(self, fn: Fn, seconds: float) -> None:
        self.driver.ubcuda_set_delay(int(fn), int(seconds * 1e9))

    def set_contention(self, seconds: float) -> None:
        self.driver.ubcuda_set_contention(int(seconds * 1e9))

    def calls(self, fn: Fn) -> int:
        return int(self.driver.ubcuda_calls(int(fn)))

    # The calls a serving engine makes, in the shapes it makes them.
    def launch_kernel(self) -> None:
        self.runtime.cudaLaunchKernel(None, self._grid, self._block, None, 0, None)

    def driver_launch_kernel(self) -> None:  # what cuBLAS and Triton do
        self.driver.cuLaunchKernel(None, 128, 1, 1, 256, 1, 1, 0, None, None, None)

    def graph_launch(self) -> None:
        self.runtime.cudaGraphLaunch(None, None)

    def copy_to_host(self, nbytes: int = 1024) -> None:
        self.runtime.cudaMemcpyAsync(self._host, None, nbytes, 2, None)

    def copy_to_device(self, nbytes: int = 1024) -> None:
        self.runtime.cudaMemcpyAsync(None, self._host, nbytes, 1, None)

    def malloc(self, nbytes: int) -> int:
        p = ctypes.c_void_p()
        self.runtime.cudaMalloc(ctypes.byref(p), nbytes)
        return int(p.value or 0)

    def synchronize(self) -> None:
        self.runtime.cudaStreamSynchronize(None)


def load(directory: Path | None = None) -> CudaStub:
    """Build if needed and load. Raises StubBuildError or OSError when impossible."""
    directory = build(directory)
    driver = ctypes.CDLL(str(directory / DRIVER_SONAME))
    runtime = ctypes.CDLL(str(directory / RUNTIME_SONAME))
    return CudaStub(runtime=runtime, driver=driver, directory=directory)


@dataclass
class WeightUpload:
    """Weights going to the device through the stub (the engine loader's Device): one
    cudaMalloc per tensor, one cudaMemcpyAsync per staged chunk, charged at PCIe speed.
    Called from one thread only: the copy's delay is set just before each call."""

    stub: CudaStub
    bytes_per_s: float = PCIE_BYTES_PER_S

    def alloc(self, nbytes: int) -> None:
        self.stub.malloc(nbytes)

    def copy(self, nbytes: int) -> None:
        self.stub.set_delay(Fn.CU_MEMCPY_HTOD_ASYNC, nbytes / self.bytes_per_s)
        self.stub.copy_to_device(nbytes)


def weight_upload() -> WeightUpload | None:
    """The loader's device factory: the stub's upload path, or None (weights are only read,
    as the engine times steps in pure Python then too) when the stub cannot be built."""
    try:
        return WeightUpload(load())
    except (StubBuildError, OSError) as e:
        log.warning("stand-in CUDA library unavailable, weights are read but not uploaded: %s", e)
        return None
