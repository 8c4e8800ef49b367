from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from helpers import UPS, Proc, engine, gateway


@pytest.fixture(scope="session", autouse=True)
def _isolated_dirs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Tests never touch the user's state; the CUDA stub cache is shared across the run."""
    base = tmp_path_factory.mktemp("unbroken")
    os.environ["UNBROKEN_STATE_DIR"] = str(base / "state")
    os.environ.setdefault("UNBROKEN_CACHE_DIR", str(base / "cache"))
    yield
    for up in UPS:  # a pipeline's data plane outlives a killed supervisor: leave none behind
        up.kill_orphans()


@pytest.fixture(scope="module")
def logdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def shared_engine(logdir: Path) -> Iterator[Proc]:
    p = engine(logdir, name="shared")
    yield p
    p.stop()


@pytest.fixture(scope="module")
def shared_gateway(logdir: Path) -> Iterator[tuple[Proc, Proc, Proc]]:
    """Two engines behind one gateway."""
    a = engine(logdir, name="a")
    b = engine(logdir, name="b")
    g = gateway(logdir, a.url, b.url)
    yield g, a, b
    for p in (g, a, b):
        p.stop()
