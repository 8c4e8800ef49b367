"""The example spec the README points at loads, and renders for Kubernetes: a user's first
`unbroken up examples/pipeline.yaml` must not start with a spec error."""

from __future__ import annotations

from pathlib import Path

from unbroken.config.spec import load_spec
from unbroken.k8s import RenderOptions, render

EXAMPLE = Path(__file__).parent.parent / "examples" / "pipeline.yaml"


def test_the_example_spec_loads_and_renders() -> None:
    spec = load_spec(EXAMPLE)
    assert [p.name for p in spec.pools] == ["primary", "fallback", "coder"]
    coder = spec.pools[2]
    assert coder.autoscale is not None and coder.autoscale.min == 0
    assert coder.model_of(spec) == "qwen-coder-7b"
    kinds = {o["kind"] for o in render(spec, RenderOptions(autoscaler="keda"))}
    assert {"Deployment", "Service", "ScaledObject"} <= kinds
