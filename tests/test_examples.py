"""The example spec the README points at loads, and renders for Kubernetes: a user's first
`unbroken up examples/pipeline.yaml` must not start with a spec error."""

from __future__ import annotations

from pathlib import Path

from unbroken.config.spec import load_spec, parse_spec
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


def _controller_args(spec: object) -> list[str]:
    for o in render(spec, RenderOptions()):  # type: ignore[arg-type]
        if o["kind"] == "Deployment" and "controller" in o["metadata"]["name"]:
            return list(o["spec"]["template"]["spec"]["containers"][0]["args"])
    raise AssertionError("no controller Deployment rendered")


def test_the_examples_fp8_fallback_is_the_controllers_degraded_tier() -> None:
    """A review of the rendered example: its `fallback` pool (`engine: {profile: fp8}`, no
    `precision:`) rendered as fp16, so the controller had no degraded tier. A simulator
    pool's precision is now its profile's unless given, and the example says it too."""
    spec = load_spec(EXAMPLE)
    assert spec.pools[1].precision == "fp8"
    args = _controller_args(spec)
    assert args[args.index("--degraded-pool") + 1] == "fallback", args
    alone = parse_spec({"pools": [{"name": "a"}, {"name": "b", "engine": {"profile": "fp8"}}]})
    assert [p.precision for p in alone.pools] == ["fp16", "fp8"]
    given = parse_spec(
        {"pools": [{"name": "b", "precision": "fp16", "engine": {"profile": "fp8"}}]}
    )
    assert given.pools[0].precision == "fp16"  # what the spec says wins
