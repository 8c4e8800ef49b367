"""Prepare the real-vLLM tier ahead of its tests: install vLLM and build the models
(vllmstack.install_vllm, build_models: both cached and locked), so that the fixtures that do
the same find them done or wait for them. tests/conftest.py starts this in the background
when a run collects the tier, so that a fresh machine's install (~1.5 min) overlaps the
other tests instead of holding the whole machine in a `serial` test's setup. Its output:
~/.cache/unbroken/vllm-prepare.log."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from vllmstack import CACHE, build_models, install_vllm  # noqa: E402


def main() -> int:
    CACHE.mkdir(parents=True, exist_ok=True)
    with (
        open(CACHE / "vllm-prepare.log", "a") as log,
        contextlib.redirect_stdout(log),
        contextlib.redirect_stderr(log),
    ):
        try:
            build_models(install_vllm())
        except RuntimeError as e:
            print(e, file=sys.stderr)  # the fixture tries again and fails the tier with it
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
