"""The garbage collector in the long-running processes.

CPython's full (generation 2) collection walks every tracked container in the process, and
most of them are made at import time (modules, classes, pydantic schemas, typer and rich).
Measured on the 2-core VM during `unbroken demo` (gc.callbacks in every process): a full
collection took 50 ms in an engine, 118 ms in a gateway worker and 93-97 ms in the demo's
load generator: a pause of every stream that process carries, the size of the demo's
p99.9 TTFT tail. `gc.freeze()` once a server has started moves what exists then into the
permanent generation, which no later collection visits; what requests allocate afterwards
is collected as before.
"""

from __future__ import annotations

import gc

__all__ = ["freeze_startup_heap"]


def freeze_startup_heap() -> None:
    """Call once, when start-up is done and before serving: collect the start-up garbage
    (so that it is not frozen for good), then freeze the rest."""
    gc.collect()
    gc.freeze()
