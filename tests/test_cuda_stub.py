"""The stand-in CUDA libraries: entry points shaped like the real ones, exact calls, real time."""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest

from unbroken.engine.cuda import DRIVER_SONAME, RUNTIME_SONAME, Fn, load

RUNTIME_FNS = [
    "cudaLaunchKernel",
    "cudaGraphLaunch",
    "cudaMalloc",
    "cudaMemcpyAsync",
    "cudaStreamSynchronize",
]
DRIVER_FNS = [
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cuGraphLaunch",
    "cuMemAlloc_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuStreamSynchronize",
]


@pytest.fixture(scope="module")
def stub():  # type: ignore[no-untyped-def]
    return load()


def test_entry_points_begin_with_push_rbp(stub) -> None:  # type: ignore[no-untyped-def]
    if shutil.which("objdump") is None:
        pytest.skip("objdump (binutils) is not installed; needed to read prologues")
    for lib, fns in ((RUNTIME_SONAME, RUNTIME_FNS), (DRIVER_SONAME, DRIVER_FNS)):
        out = subprocess.run(
            ["objdump", "-d", "--no-show-raw-insn", str(stub.directory / lib)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for fn in fns:
            block = out.split(f"<{fn}>:\n", 1)[1]
            first = block.splitlines()[0].split(":", 1)[1].strip()
            assert first.startswith("push") and "%rbp" in first, (fn, first)


def test_runtime_calls_go_through_the_driver_once(stub) -> None:  # type: ignore[no-untyped-def]
    before = {f: stub.calls(f) for f in Fn}
    for _ in range(100):
        stub.launch_kernel()
    for _ in range(7):
        stub.driver_launch_kernel()
    stub.graph_launch()
    stub.copy_to_host()
    stub.copy_to_device()
    stub.synchronize()
    assert stub.malloc(1000) != 0
    delta = {f: stub.calls(f) - before[f] for f in Fn}
    assert delta[Fn.CU_LAUNCH_KERNEL] == 107
    assert delta[Fn.CU_GRAPH_LAUNCH] == 1
    assert delta[Fn.CU_MEMCPY_DTOH_ASYNC] == 1 and delta[Fn.CU_MEMCPY_HTOD_ASYNC] == 1
    assert delta[Fn.CU_STREAM_SYNCHRONIZE] == 1 and delta[Fn.CU_MEM_ALLOC] == 1


def test_calls_take_the_time_asked(stub) -> None:  # type: ignore[no-untyped-def]
    stub.set_delay(Fn.CU_STREAM_SYNCHRONIZE, 0.02)
    t0 = time.perf_counter()
    stub.synchronize()
    took = time.perf_counter() - t0
    stub.set_delay(Fn.CU_STREAM_SYNCHRONIZE, 0)
    assert 0.02 <= took < 0.03
    stub.set_contention(0.005)
    t0 = time.perf_counter()
    stub.launch_kernel()
    took = time.perf_counter() - t0
    stub.set_contention(0)
    assert 0.005 <= took < 0.015
