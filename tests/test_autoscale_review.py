"""A KEDA / production-stack user's review of autoscaling (2026-12-07): the spec refuses a
target the gateway's cap would never let demand reach, and names the fields as written; the
spill to a fallback tier (local and on the cluster) follows when the gateway really sends it
work; the render says what it changes of the spec's autoscaling; `unbroken scale` answers on
stdout; `unbroken status` shows a resize on its own pool's line only. In-process, no
pipeline started."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from unbroken.config.spec import SpecError, parse_spec
from unbroken.controller.autoscale import Autoscaler, PoolScaling
from unbroken.k8s.autoscale import DEMAND_METRIC, autoscale_cautions, wanted_query
from unbroken.k8s.manifests import SCRAPE_S
from unbroken.pipeline import up as up_mod
from unbroken.pipeline.supervisor import Supervisor


def _pool(**kw: Any) -> dict[str, Any]:
    return {"pools": [{"name": "p", **kw}]}


# -- 1. scaling.target above the cap ---------------------------------------------------------
def test_a_target_above_the_cap_is_refused_naming_both() -> None:
    with pytest.raises(SpecError) as e:
        parse_spec(_pool(replicas={"min": 1, "max": 3}, cap=2, scaling={"target": 4}))
    msg = str(e.value)
    assert "scaling.target (4) exceeds its cap (2)" in msg and "at most 2" in msg, msg
    # The default target against the gateway's default cap: both said to be defaults.
    with pytest.raises(SpecError) as e:
        parse_spec({**_pool(replicas={"min": 1, "max": 3}), "gateway": {"default_cap": 8}})
    assert "scaling.target (48, the default) exceeds its cap (8, gateway.default_cap)" in str(
        e.value
    )
    # At the cap, or a fixed pool (no target used), is fine; so is the documented default.
    parse_spec(_pool(replicas={"min": 1, "max": 3}, cap=4, scaling={"target": 4}))
    parse_spec(_pool(replicas=2, cap=2))
    parse_spec(_pool(replicas={"min": 1, "max": 3}))


def test_reload_and_render_read_the_same_refusal(tmp_path: Path) -> None:
    """`unbroken reload` and `render k8s` load the spec through the same validation."""
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        yaml.safe_dump(_pool(replicas={"min": 1, "max": 3}, cap=2, scaling={"target": 4}))
    )
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "unbroken",
            "render",
            "k8s",
            str(spec),
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode != 0 and "scaling.target (4) exceeds its cap (2)" in p.stderr, p.stderr


# -- 2. the spill follows the gateway's cap --------------------------------------------------
def test_the_fallback_wakes_only_for_what_the_gateway_would_send_it() -> None:
    """The review's case: primary {1, 1} at target 2 (cap 256), fallback {0, 1}: 6 streams
    all run on the primary (the gateway spills only when it is full by cap), so the
    fallback must not wake; 260 (4 over 1 x 256, queued) wake it."""
    primary = PoolScaling("primary", 1, 1, 2.0, spill_to="fb", cap=256)
    fb = PoolScaling("fb", 0, 1, 2.0, cap=256)
    a = Autoscaler([primary, fb])
    assert a.wanted({"primary": 6.0})["fb"] == (0, 0.0)
    assert a.step(0.0, {"primary": 6.0}, {"primary": 1, "fb": 0}) == []
    assert a.wanted({"primary": 260.0})["fb"] == (2, 4.0)
    (d,) = a.step(10.0, {"primary": 260.0}, {"primary": 1, "fb": 0})
    assert (d.pool, d.desired) == ("fb", 1) and "waking" in d.reason
    # Without a cap (a caller that does not pass it) the room stays max x target.
    old = Autoscaler(
        [PoolScaling("primary", 1, 1, 2.0, spill_to="fb"), PoolScaling("fb", 0, 1, 2.0)]
    )
    assert old.wanted({"primary": 6.0})["fb"] == (2, 4.0)


def test_a_primary_that_cannot_grow_spills_what_its_replicas_cannot_hold() -> None:
    """A review's: primary max 4 (cap 256) that the supervisor cannot grow past 2 (no
    memory: `limited`) holds 512, not 1,024: 600 in demand wakes the fallback for 88 (with
    the room at max x cap alone, the 88 waited in the gateway's queue and timed out)."""
    primary = PoolScaling("primary", 1, 4, 48.0, spill_to="fb", cap=256)
    fb = PoolScaling("fb", 0, 2, 48.0, cap=256)
    a = Autoscaler([primary, fb])
    assert a.wanted({"primary": 600.0})["fb"] == (0, 0.0)
    assert a.wanted({"primary": 600.0}, limited={"primary": 2})["fb"] == (2, 88.0)
    (d,) = a.step(0.0, {"primary": 600.0}, {"primary": 2, "fb": 0}, busy={"primary"},
                  limited={"primary": 2})  # fmt: skip
    assert (d.pool, d.desired) == ("fb", 2) and "waking" in d.reason


def _spill_spec(**gateway: Any) -> Any:
    return parse_spec(
        {
            "model": "m",
            "pools": [
                {"name": "primary", "replicas": {"min": 1, "max": 2}, "scaling": {"target": 10}},
                {
                    "name": "other",
                    "model": "x",
                    "replicas": {"min": 0, "max": 2},
                    "scaling": {"target": 8},
                },
                {
                    "name": "fallback",
                    "precision": "fp8",
                    "replicas": {"min": 0, "max": 2},
                    "cap": 6,
                    "scaling": {"target": 4},
                },
                {"name": "last", "replicas": {"min": 0, "max": 3}, "scaling": {"target": 5}},
            ],
            "gateway": {"default_cap": 16, **gateway},
        }
    )


def test_the_keda_query_spills_above_max_times_cap() -> None:
    spec = _spill_spec()
    by = {p.name: p for p in spec.pools}
    assert spec.pool_cap(by["primary"]) == 16 and spec.pool_cap(by["fallback"]) == 6
    q = wanted_query("llm", spec, by["fallback"])
    assert q.endswith(f'clamp_min(sum({DEMAND_METRIC}{{namespace="llm",pool="primary"}}) - 32, 0)')
    q = wanted_query("llm", spec, by["last"])
    assert " - 12, 0)" in q and " - 32, 0)" in q  # fallback: 2 x 6; primary: 2 x 16


# -- 3, 4, 7. render warnings ----------------------------------------------------------------
def _elastic(**kw: Any) -> Any:
    return parse_spec(
        {
            "model": "meta-llama/Llama-3.1-8B-Instruct",
            "pools": [
                {"name": "primary", "replicas": {"min": 1, "max": 3}, **kw},
                {
                    "name": "coder",
                    "model": "Qwen/Qwen2.5-Coder-7B",
                    "replicas": {"min": 0, "max": 2},
                },
                {"name": "fixed", "model": "z", "replicas": 1},
            ],
        }
    )


def _cautions(spec: Any, autoscaler: str = "keda", engine: str = "vllm") -> list[str]:
    return autoscale_cautions(spec, autoscaler=autoscaler, engine=engine, scrape_s=SCRAPE_S)


def test_a_sleeping_vllm_pool_with_a_short_queue_timeout_is_warned_of() -> None:
    (line,) = _cautions(_elastic())
    assert line.startswith("pool coder: min: 0 sleeps") and "gateway.queue_timeout_s (30 s)" in line
    assert "at least 130" in line, line  # 2 x 5 s (poll, scrape) + engine.health_timeout_s 120
    assert _cautions(_elastic(), engine="simulator") == []  # a simulator starts in seconds
    long = _elastic().model_copy(deep=True)
    long.gateway.queue_timeout_s = 200
    assert _cautions(long) == []


def test_min_0_without_keda_is_warned_of() -> None:
    (line,) = _cautions(_elastic(), autoscaler="hpa", engine="simulator")
    assert "pool coder: min: 0 does not sleep with --autoscaler hpa" in line
    assert "minReplicas: 1" in line
    (line,) = _cautions(_elastic(), autoscaler="none", engine="simulator")
    assert "pool coder: min: 0 does not sleep with --autoscaler none" in line


def test_hpa_bounds_that_cut_the_spec_are_warned_of() -> None:
    spec = _elastic(scaling={"down_quiet_s": 7200, "up_cooldown_s": 0})
    lines = _cautions(spec, engine="simulator")
    (line,) = lines
    assert (
        "pool primary" in line and "down_quiet_s 7200 s -> stabilizationWindowSeconds 3600" in line
    )
    assert "up_cooldown_s" not in line  # 0 s as 1 s: no difference worth a warning
    assert _cautions(spec, autoscaler="none", engine="simulator")[0].startswith("pool coder")


def test_the_cli_prints_the_render_warnings(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "model": "meta-llama/Llama-3.1-8B-Instruct",
                "pools": [{"name": "coder", "replicas": {"min": 0, "max": 2}}],
            }
        )
    )
    p = subprocess.run(
        [sys.executable, "-m", "unbroken", "render", "k8s", str(spec), "--out", str(tmp_path / "o"),
         "--autoscaler", "hpa"],
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "warning: pool coder: min: 0 does not sleep with --autoscaler hpa" in p.stderr, p.stderr


# -- 5, 6. spec errors -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("replicas", "says"),
    [
        ({"min": 3, "max": 1}, "pools.0.replicas: min (3) must not exceed max (1)"),
        ({"min": 0, "max": 0}, "pools.0.replicas.max: Input should be greater than or equal to 1"),
        ({"min": -1, "max": 2}, "pools.0.replicas.min: Input should be greater than or equal to 0"),
        ({"min": 1, "max": 65}, "pools.0.replicas.max: Input should be less than or equal to 64"),
    ],
)
def test_range_errors_name_replicas_once(replicas: dict[str, int], says: str) -> None:
    with pytest.raises(SpecError) as e:
        parse_spec(_pool(replicas=replicas))
    msg = str(e.value)
    assert msg == f"spec: {says}", msg  # one error, where the user wrote it
    assert "autoscale" not in msg


def test_scaling_on_a_fixed_pool_is_refused() -> None:
    with pytest.raises(SpecError, match=r"pools\.0: scaling: is for autoscaled pools only"):
        parse_spec(_pool(replicas=2, scaling={"target": 10}))
    # A spec read back from its dump (a reload's diff) carries default scaling: fine.
    s = parse_spec({"pools": [{"name": "a", "replicas": 2}, {"name": "b", "replicas": {"max": 2}}]})
    again = parse_spec(s.model_dump(mode="json"))
    assert again.pools[0].autoscale is None and again.pools[1].autoscale == s.pools[1].autoscale


# -- 8. `unbroken scale` answers on stdout ---------------------------------------------------
def test_scale_prints_its_result_on_stdout(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from rich.console import Console

    async def scale(self: Any, pool: str, n: int, reason: str) -> dict[str, Any]:
        return {"ok": True, "from": 2, "replicas": n, "seconds": 0.03, "removed": ["p-4"]}

    monkeypatch.setattr(
        up_mod.RunInfo, "read", staticmethod(lambda _: SimpleNamespace(control_socket="x"))
    )
    monkeypatch.setattr(up_mod.SupervisorClient, "scale", scale)
    assert up_mod.scale_cli("p", 1, console=Console(stderr=True)) == 0
    out, err = capsys.readouterr()
    assert out == "pool p: 2 -> 1 replica(s) in 0.03 s; removed p-4\n", (out, err)
    assert "pool p" not in err


# -- 9. a resize shows on its own pool's line ------------------------------------------------
def test_status_shows_a_resize_on_its_pool_only() -> None:
    spec = parse_spec(
        {
            "pools": [
                {"name": "primary", "replicas": {"min": 1, "max": 1}},
                {"name": "fb", "replicas": {"min": 0, "max": 1}},
            ]
        }
    )
    sup = SimpleNamespace(
        resizing=("fb", 1),
        scaling="fb -> 1",
        replica_set=SimpleNamespace(serving=lambda name: {"primary": 1}.get(name, 0)),
    )
    pools = {p.name: Supervisor._pool_status(sup, p) for p in spec.pools}  # type: ignore[arg-type]
    lines = up_mod.status_lines({"pools": pools, "events": []})
    (pl,) = (x for x in lines if x.startswith("autoscale primary"))
    (fl,) = (x for x in lines if x.startswith("autoscale fb"))
    assert pl == "autoscale primary: 1 live, 1 wanted, in [1, 1]", pl
    assert fl == "autoscale fb: 0 live, 1 wanted, in [0, 1]; resizing fb -> 1", fl
