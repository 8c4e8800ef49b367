"""Prepare the real-vLLM tier ahead of its tests: install vLLM (scripts/vllm-venv.sh) and
build the models (vllmstack.build_models), both cached and locked, so that the fixtures that
do the same find them done or wait for them. tests/conftest.py starts this in the background
when a run collects the tier, so that a fresh machine's install (~1.5 min) overlaps the
other tests instead of holding the whole machine in a `serial` test's setup. Its output:
~/.cache/unbroken/vllm-prepare.log."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from vllmstack import ROOT, build_models  # noqa: E402


def main() -> int:
    r = subprocess.run([str(ROOT / "scripts" / "vllm-venv.sh")], capture_output=True, text=True)
    if r.returncode != 0:
        print(r.stderr[-3000:], file=sys.stderr)
        return 1  # the fixture runs the script again and fails the tier with its reason
    build_models(Path(r.stdout.strip().splitlines()[-1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
