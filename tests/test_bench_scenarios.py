"""`unbroken bench`'s scenarios against a real pipeline (`unbroken up`): a scenario that fails
or errors fails the run (with the report written), a bad --pool or --at is refused before any
load, the load covers the whole scenario window, and the run says which URL it loads."""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from helpers import Up, small_up
from unbroken.bench.control import PipelineControl
from unbroken.bench.load import LoadConfig
from unbroken.bench.runner import run_bench
from unbroken.config.paths import RunInfo


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Up:
    u = small_up(tmp_path_factory.mktemp("bench-scenarios"))
    yield u
    u.stop()


def _in_process(u: Up, out: Path, scenario: str, pool: str) -> dict[str, Any]:
    """`run_bench` as the command calls it, past the command's own --pool check (what a
    scenario that goes wrong mid-run looks like)."""
    info = RunInfo.read(u.state)
    assert info is not None
    cfg = LoadConfig(url=u.url, users=4, spawn_rate=0, duration=3, max_tokens=(8, 16))
    return asyncio.run(
        run_bench(
            cfg,
            scenario=scenario,
            at=1.0,
            pool=pool,
            deadline_s=5.0,
            out=out,
            control=PipelineControl(info.control_socket),
            sampler=None,
            console=Console(file=io.StringIO(), width=200),
            command="test",
        )
    )


def test_unknown_pool_is_refused_before_the_load(pipeline: Up, tmp_path: Path) -> None:
    """Was: the rollout's refusal recorded and exit 0; chaos a traceback and no report."""
    for scenario in ("rollout", "chaos"):
        out = tmp_path / scenario
        r = pipeline.run(
            "bench",
            "--scenario",
            scenario,
            "--pool",
            "nosuch",
            "--duration",
            "4",
            "--at",
            "1",
            "--users",
            "5",
            "--out",
            str(out),
        )
        assert r.returncode == 2, r.stderr
        assert "--pool 'nosuch': the pipeline has no such pool (its pools: primary)" in r.stderr
        assert "Traceback" not in r.stderr and not out.exists()  # no load was sent


def test_a_refused_rollout_fails_the_run_with_the_supervisors_error(
    pipeline: Up, tmp_path: Path
) -> None:
    result = _in_process(pipeline, tmp_path, "rollout", "nosuch")
    # the supervisor's own words
    assert result["failures"] == [
        "the rollout of pool 'nosuch' failed: no pool named 'nosuch' (pools: primary)"
    ]
    data = json.loads((tmp_path / "results.json").read_text())
    end = next(e for e in data["events"] if e["event"] == "rollout_end")
    assert end["ok"] is False and "nosuch" in end["error"]
    assert [c["ok"] for c in data["checks"]] == [True, False]  # the load itself was fine


def test_a_scenario_error_is_a_clean_failure_with_the_report(pipeline: Up, tmp_path: Path) -> None:
    result = _in_process(pipeline, tmp_path, "chaos", "nosuch")  # raised RuntimeError
    assert result["failures"] == [
        "the chaos scenario failed: RuntimeError: no live replica in pool 'nosuch'"
    ]
    assert (tmp_path / "report.html").exists()
    data = json.loads((tmp_path / "results.json").read_text())
    assert [e["event"] for e in data["events"]] == ["scenario_error"]
    assert data["records"] and data["checks"][-1]["ok"] is False


def test_at_not_before_duration_is_refused(pipeline: Up, tmp_path: Path) -> None:
    """Was: a real rollout after the load had stopped, 0 requests in its window, exit 0."""
    r = pipeline.run(
        "bench", "--scenario", "rollout", "--duration", "3", "--at", "6", "--out", str(tmp_path)
    )
    assert r.returncode == 2, r.stderr
    assert "--at 6 is not before the load's end (--duration 3)" in r.stderr
    assert not tmp_path.joinpath("results.json").exists()


def test_the_load_covers_a_scenario_that_outlasts_duration(pipeline: Up, tmp_path: Path) -> None:
    """A rollout at 1 s of a 3 s run takes seconds; its window (its end + 5 s) used to run
    past the load's end and the whole run's window, with no traffic in its last part."""
    r = pipeline.run(
        "bench",
        "--scenario",
        "rollout",
        "--duration",
        "3",
        "--at",
        "1",
        "--users",
        "6",
        "--max-tokens",
        "16:32",
        "--out",
        str(tmp_path),
    )
    assert r.returncode == 0, r.stderr
    data = json.loads((tmp_path / "results.json").read_text())
    assert [(e["event"], e.get("ok")) for e in data["events"]] == [
        ("rollout_start", None),
        ("rollout_end", True),
    ]
    w, whole = data["windows"]["rollout"], data["windows"]["whole run"]
    assert w["end"] <= whole["end"], (w, whole)
    # requests were still being started in the window's last second
    assert any(w["end"] - 1.5 <= rec["start"] < w["end"] for rec in data["records"])
    assert w["open"]["streams"] > 0 and w["open"]["dropped"] == 0
    assert data["checks"][-1] == {
        "metric": "rollout done, under load",
        "measured": "done",
        "target": "done, with streams open in its window",
        "ok": True,
    }
    assert "the rollout is still running at --duration (3 s): the load goes on" in r.stderr
    assert f"target: {pipeline.url} (the gateway of the pipeline running in" in r.stderr


def test_a_failing_scenario_command_fails_the_run(pipeline: Up, tmp_path: Path) -> None:
    """--scenario-command on the user's own engines (here the pipeline's gateway, with no
    pipeline in the state dir): a command that exits non-zero is a failed scenario."""
    env = {**os.environ, "UNBROKEN_STATE_DIR": str(tmp_path / "state")}
    for scenario, why in (
        ("rollout", "FAIL: the rollout of pool 'primary' failed: `exit 3` exited 3"),
        ("chaos", "FAIL: the chaos command failed: `exit 3` exited 3"),
    ):
        out = tmp_path / scenario
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "unbroken",
                "bench",
                "--url",
                pipeline.url,
                "--scenario",
                scenario,
                "--scenario-command",
                "exit 3",
                "--duration",
                "2",
                "--at",
                "0.5",
                "--users",
                "3",
                "--max-tokens",
                "8:16",
                "--out",
                str(out),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 1, r.stderr
        assert why in r.stderr and f"target: {pipeline.url} (from --url)" in r.stderr
        assert (out / "report.html").exists()


def test_the_default_target_is_said(tmp_path: Path) -> None:
    """No pipeline in the state dir and no --url: the run says it falls back to the default
    URL (here stopped by a bad option right after, so nothing is sent to it)."""
    env = {**os.environ, "UNBROKEN_STATE_DIR": str(tmp_path)}
    r = subprocess.run(
        [sys.executable, "-m", "unbroken", "bench", "--reference-url", "nourl"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2
    line = " ".join(r.stderr.split())  # rich may wrap it
    assert (
        f"target: http://127.0.0.1:8080 (the default: no --url, and no pipeline running in "
        f"{tmp_path} (UNBROKEN_STATE_DIR)"
    ) in line, r.stderr
