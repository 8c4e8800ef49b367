"""The CUDA entry points the agent times; a function's id (its index) is the attach cookie."""

from __future__ import annotations

import re

__all__ = ["FUNCTIONS", "LIBRARY_RE"]

FUNCTIONS: tuple[str, ...] = (
    # runtime (libcudart)
    "cudaLaunchKernel",
    "cudaGraphLaunch",
    "cudaMalloc",
    "cudaMemcpyAsync",
    "cudaStreamSynchronize",
    # driver (libcuda)
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cuGraphLaunch",
    "cuMemAlloc_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuStreamSynchronize",
)
FN_ID = {name: i for i, name in enumerate(FUNCTIONS)}

# Real CUDA libraries and the simulator's stand-ins, by file name.
LIBRARY_RE = re.compile(rb"/(lib(?:cuda|cudart|unbroken_cuda|unbroken_cudart)\.so(?:\.[0-9]+)*)$")
