"""What a Prometheus server sees from the gateway and the agent: output that prometheus_client's
own parser reads, `unbroken_build_info` and `process_*` on each, labelled counters present at 0
before anything happened, the gateway's unknown-route counter, and (where Debian's
`prometheus` package is installed) `promtool check metrics` passing."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers import Proc, engine, gateway, metric
from unbroken import __version__
from unbroken.wire.http import free_port

PROMTOOL = shutil.which("promtool")


@pytest.fixture(scope="module")
def exporters(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Proc]]:
    tmp = tmp_path_factory.mktemp("exporters")
    e = engine(tmp)
    g = gateway(tmp, e.url)
    port = free_port()
    a = Proc(
        [sys.executable, "-m", "unbroken", "agent", "--no-ebpf", "--listen", f"127.0.0.1:{port}"],
        port,
        tmp / "agent.log",
    ).start()
    yield g, a
    for p in (a, g, e):
        p.stop()


def _families(url: str) -> dict[str, object]:
    text = httpx.get(url + "/metrics", timeout=5).text
    return {f.name: f for f in text_string_to_metric_families(text)}


@pytest.mark.parametrize("which", ["gateway", "agent"])
def test_build_info_and_process_metrics(exporters: tuple[Proc, Proc], which: str) -> None:
    g, a = exporters
    fams = _families(g.url if which == "gateway" else a.url)
    info = fams["unbroken_build_info"]  # a gauge in the text format
    (sample,) = info.samples  # type: ignore[attr-defined]
    assert sample.name == "unbroken_build_info" and sample.value == 1
    assert sample.labels["version"] == __version__ and sample.labels["component"] == which
    for name in (
        "process_cpu_seconds",
        "process_resident_memory_bytes",
        "process_start_time_seconds",
    ):
        assert name in fams, name
    assert fams["process_resident_memory_bytes"].samples[0].value > 1e6  # type: ignore[attr-defined]


@pytest.mark.parametrize("which", ["gateway", "agent"])
def test_every_family_is_typed(exporters: tuple[Proc, Proc], which: str) -> None:
    """The gateway merges its workers' expositions and writes the text itself: a counter
    written as `# TYPE x counter` with `x_total` samples reads as an untyped `x_total`."""
    g, a = exporters
    fams = _families(g.url if which == "gateway" else a.url)
    untyped = sorted(n for n, f in fams.items() if f.type == "unknown")  # type: ignore[attr-defined]
    assert not untyped, untyped
    if which == "gateway":
        assert fams["unbroken_gateway_requests"].type == "counter"  # type: ignore[attr-defined]
        assert fams["unbroken_gateway_ttft_seconds"].type == "histogram"  # type: ignore[attr-defined]


def test_gateway_counters_start_at_zero_and_unknown_routes_count(
    exporters: tuple[Proc, Proc],
) -> None:
    g, _a = exporters
    # Before any shed, migration or drop: the series exist, at 0 (increase() gives 0, not
    # "no data").
    assert metric(g.url, "unbroken_gateway_shed_total", priority="sheddable", reason="shed") == 0
    assert metric(g.url, "unbroken_gateway_streams_migrated_total", reason="drain_deadline") == 0
    assert metric(g.url, "unbroken_gateway_streams_dropped_total", pool="default") == 0
    assert metric(g.url, "unbroken_gateway_requests_total", status="503", pool="default") == 0
    before = metric(g.url, "unbroken_gateway_unknown_route_requests_total", method="POST")
    for _ in range(3):  # the base-URL mistake: /v1 twice
        r = httpx.post(g.url + "/v1/v1/chat/completions", json={}, timeout=5)
        err = r.json()["error"]
        assert r.status_code == 404 and err["code"] == "unknown_route"
        assert (
            "/v1/v1/chat/completions" in err["message"] and "POST /v1/completions" in err["message"]
        )
    after = metric(g.url, "unbroken_gateway_unknown_route_requests_total", method="POST")
    assert after - before == 3
    # A known path with the wrong method is a 405, not an unknown route.
    assert httpx.get(g.url + "/v1/completions", timeout=5).status_code == 405
    assert metric(g.url, "unbroken_gateway_unknown_route_requests_total", method="GET") == 0


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (apt-get install prometheus)")
@pytest.mark.parametrize("which", ["gateway", "agent"])
def test_promtool_check_metrics(exporters: tuple[Proc, Proc], which: str, tmp_path: Path) -> None:
    g, a = exporters
    text = httpx.get((g.url if which == "gateway" else a.url) + "/metrics", timeout=5).text
    assert PROMTOOL is not None
    r = subprocess.run(
        [PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == "" and r.stderr.strip() == ""  # not even a lint warning


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (apt-get install prometheus)")
def test_promtool_check_recording_rules() -> None:
    rules = Path(__file__).parent.parent / "deploy" / "prometheus" / "recording-rules.yaml"
    assert PROMTOOL is not None
    r = subprocess.run(
        [PROMTOOL, "check", "rules", str(rules)], capture_output=True, text=True, timeout=30
    )
    assert r.returncode == 0 and "SUCCESS: 3 rules found" in r.stdout, r.stdout + r.stderr
    assert "by (le, endpoint, pod, namespace)" in rules.read_text()  # engines stay apart off k8s
