"""A same-model fallback at `min: 0` wakes on a cluster: its KEDA query adds what the pools
before it cannot hold at their `max` (k8s/autoscale.py, `wanted_query`), as the local
autoscaler spills (controller/autoscale.py). The rendered PromQL is evaluated by Prometheus's
own engine (`promtool test rules`) over the gateway's demand series of two gateway pods."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from unbroken.config.spec import parse_spec
from unbroken.controller.autoscale import Autoscaler, PoolScaling
from unbroken.k8s import RenderOptions, render
from unbroken.k8s.autoscale import DEMAND_METRIC, spill_chain

NS = "llm"


def _spec() -> Any:
    return parse_spec(
        {
            "model": "m",
            "pools": [
                # Caps at the targets: the gateway moves work on at a replica's cap, so the
                # spill's room is max x cap (docs/pipeline.md, "Autoscaling").
                {
                    "name": "primary",
                    "replicas": {"min": 1, "max": 2},
                    "cap": 10,
                    "scaling": {"target": 10},
                },
                {"name": "other", "model": "x", "replicas": {"min": 0, "max": 2}},
                {
                    "name": "fallback",
                    "precision": "fp8",
                    "replicas": {"min": 0, "max": 2},
                    "cap": 4,
                    "scaling": {"target": 4},
                },
                {
                    "name": "last",
                    "replicas": {"min": 0, "max": 3},
                    "cap": 5,
                    "scaling": {"target": 5},
                },
            ],
        }
    )


def _queries() -> dict[str, str]:
    objs = render(_spec(), RenderOptions(namespace=NS, autoscaler="keda"))
    return {
        o["metadata"]["name"].removeprefix("unbroken-"): o["spec"]["triggers"][0]["metadata"][
            "query"
        ]
        for o in objs
        if o["kind"] == "ScaledObject"
    }


def test_spill_chain_follows_the_model() -> None:
    spec = _spec()
    by = {p.name: p for p in spec.pools}
    assert [p.name for p in spill_chain(spec, by["fallback"])] == ["primary", "fallback"]
    assert [p.name for p in spill_chain(spec, by["last"])] == ["primary", "fallback", "last"]
    assert [p.name for p in spill_chain(spec, by["other"])] == ["other"]  # another model
    assert [p.name for p in spill_chain(spec, by["primary"])] == ["primary"]


@pytest.mark.parametrize(
    "demand",
    [
        {"primary": 0, "other": 0, "fallback": 0, "last": 0},
        {"primary": 35, "other": 1, "fallback": 0, "last": 0},  # 15 over primary's 2 x 10
        {"primary": 50, "other": 0, "fallback": 3, "last": 0},  # fallback over its 2 x 4 too
        {"primary": 12, "other": 0, "fallback": 9, "last": 2},
    ],
)
def test_keda_query_spills_as_the_local_autoscaler(tmp_path: Path, demand: dict[str, int]) -> None:
    """Each pool's demand is split over two gateway pods; Prometheus evaluates each pool's
    rendered query, and the value equals the demand the local autoscaler sizes it for."""
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed (make setup installs the prometheus package)")
    queries = _queries()
    assert set(queries) == {"primary", "other", "fallback", "last"}
    spec = _spec()
    local = Autoscaler(
        [
            PoolScaling(
                name=p.name,
                min=p.autoscale.min,
                max=p.autoscale.max,
                target=p.scaling.target,
                cap=spec.pool_cap(p),
                spill_to={"primary": "fallback", "fallback": "last"}.get(p.name),
            )
            for p in spec.pools
            if p.autoscale is not None
        ]
    )
    want = {k: d for k, (_, d) in local.wanted({k: float(v) for k, v in demand.items()}).items()}
    series = []
    for pool, n in demand.items():
        for pod, part in (("gw-a", n // 2), ("gw-b", n - n // 2)):
            labels = f'namespace="{NS}",pool="{pool}",pod="{pod}"'
            series.append({"series": f"{DEMAND_METRIC}{{{labels}}}", "values": f"{part}x3"})
    rules = tmp_path / "rules.yaml"
    rules.write_text(
        yaml.safe_dump(
            {
                "groups": [
                    {
                        "name": "wanted",
                        "rules": [
                            {"record": f"wanted:{pool}", "expr": q} for pool, q in queries.items()
                        ],
                    }
                ]
            }
        )
    )
    test = tmp_path / "test.yaml"
    test.write_text(
        yaml.safe_dump(
            {
                "rule_files": [str(rules)],
                "evaluation_interval": "1m",
                "tests": [
                    {
                        "interval": "1m",
                        "input_series": series,
                        "promql_expr_test": [
                            {
                                "expr": f"wanted:{pool}",
                                "eval_time": "2m",
                                "exp_samples": [{"labels": f"wanted:{pool}", "value": want[pool]}],
                            }
                            for pool in queries
                        ],
                    }
                ],
            }
        )
    )
    p = subprocess.run(
        ["promtool", "test", "rules", str(test)], capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 0, p.stdout + p.stderr
    if demand["primary"] > 20:
        assert want["fallback"] > demand["fallback"]  # the case the query exists for
