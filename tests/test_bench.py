"""The verifier: load records, outcomes, percentiles, report files, and the demo itself."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from helpers import Proc, engine, gateway
from unbroken.bench.demo import rank_note
from unbroken.bench.load import LoadConfig, LoadRun, Record, base_url
from unbroken.bench.report import write_report
from unbroken.bench.runner import error_counts, make_window, verdict, window_counts
from unbroken.bench.stats import percentile, summarize


def test_percentile_is_nearest_rank() -> None:
    xs = [float(i) for i in range(1, 1001)]
    assert percentile(xs, 50) == 500.0
    assert percentile(xs, 99.9) == 999.0
    assert percentile(xs, 100) == 1000.0
    assert percentile([], 50) is None


def _rec(start: float, end: float, outcome: str, ttft: float = 0.1) -> Record:
    r = Record(
        user=0,
        kind="completion",
        priority="standard",
        slow=False,
        start=start,
        max_tokens=10,
        status=200,
        ttft=ttft,
        end=end,
        tokens=10,
        gaps=[0.01] * 9,
        outcome=outcome,
    )
    return r


def test_windows_count_open_streams_and_started_requests() -> None:
    recs = [_rec(0, 5, "ok"), _rec(4, 12, "dropped"), _rec(11, 13, "corrupted"), _rec(20, 21, "ok")]
    assert window_counts(recs, 10, 15) == {"dropped": 1, "corrupted": 1}
    s = summarize(recs, 10, 15)
    assert s["requests"] == 1 and s["outcomes"] == {"corrupted": 1}
    w = make_window(recs, 3, 12)
    assert w["open"] == {"dropped": 1, "corrupted": 1, "streams": 3}


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> tuple[Proc, Proc]:
    tmp = tmp_path_factory.mktemp("bench")
    e = engine(tmp)
    g = gateway(tmp, e.url)
    yield e, g
    g.stop()
    e.stop()


def test_load_run_verifies_text_and_detects_corruption(target: tuple[Proc, Proc]) -> None:
    _e, g = target
    cfg = LoadConfig(
        url=g.url,
        users=6,
        spawn_rate=50,
        duration=2.0,
        max_tokens=(5, 20),
        chat_fraction=0.5,
        slow_fraction=0.3,
        slow_delay_s=0.01,
    )
    recs = asyncio.run(LoadRun(cfg).run())
    assert len(recs) >= 6 and {r.outcome for r in recs} == {"ok"}
    assert all(r.ttft is not None and r.tokens == r.max_tokens for r in recs)
    assert {r.kind for r in recs} == {"chat", "completion"}
    # Against an engine with another seed, every text is wrong: the verifier must say so.
    wrong = LoadConfig(
        url=g.url, users=2, spawn_rate=50, duration=1.0, max_tokens=(5, 5), sim_seed=42
    )
    assert {r.outcome for r in asyncio.run(LoadRun(wrong).run())} == {"corrupted"}


def test_load_run_counts_rejections(tmp_path: Path) -> None:
    e = engine(tmp_path)
    g = gateway(tmp_path, e.url, args=("--cap", "1"))
    try:
        cfg = LoadConfig(
            url=g.url,
            users=4,
            spawn_rate=100,
            duration=1.5,
            max_tokens=(40, 40),
            priorities={"sheddable": 1.0},
        )
        outcomes = {r.outcome for r in asyncio.run(LoadRun(cfg).run())}
        assert outcomes == {"ok", "rejected"}
    finally:
        g.stop()
        e.stop()


def test_report_files(tmp_path: Path) -> None:
    recs = [_rec(i * 0.1, i * 0.1 + 1, "ok") for i in range(50)] + [_rec(2, 3, "dropped")]
    path = write_report(
        tmp_path,
        title="t",
        config={},
        records=recs,
        events=[{"t": 1.0, "event": "rollout_start"}],
        samples=[{"t": 0.5, "endpoints": {"a": {"inflight": 3, "state": "ready", "pool": "p"}}}],
        windows={},
        markdown="| x |",
    )
    assert path.name == "report.html"
    for name in ("ttft.png", "streams.png", "tokens.png", "results.json", "summary.md"):
        assert (tmp_path / name).stat().st_size > 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert len(data["records"]) == 51 and data["events"][0]["event"] == "rollout_start"
    assert '<img src="data:image/png;base64,' in path.read_text()  # self-contained


def test_bench_cli_steady(target: tuple[Proc, Proc], tmp_path: Path) -> None:
    _e, g = target
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "unbroken",
            "bench",
            "--url",
            g.url,
            "--users",
            "4",
            "--duration",
            "3",
            "--max-tokens",
            "8:16",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert "whole run" in r.stderr and (tmp_path / "report.html").exists()
    assert f"target: {g.url} (from --url)" in r.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "unbroken", "bench", "--url", g.url, "--max-tokens", "9:3"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert bad.returncode == 2


def test_base_url_accepts_the_sdk_form() -> None:
    for url in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/", " http://h:1 "):
        assert base_url(url) == "http://h:1"
    assert base_url("http://h:1/prefix/v1") == "http://h:1/prefix"


def test_verdict_and_error_counts() -> None:
    ok = [_rec(i, i + 1, "ok") for i in range(200)]
    err = _rec(5, 5.1, "error")
    err.status = 404
    refused = _rec(6, 6.1, "error")
    refused.status, refused.detail = 0, "ClientConnectorError: refused"
    assert error_counts([*ok, err, refused]) == {"HTTP 404": 1, "ClientConnectorError": 1}
    assert verdict([*ok, err]) == []  # 1 of 201 is under the 1 % default
    assert "ended in an error" in verdict([*ok, err, err, err])[0]
    assert verdict([err]) == ["no request succeeded (1 sent; errors: HTTP 404: 1)"]
    assert verdict([*ok, _rec(3, 4, "dropped")]) == ["1 dropped stream(s)"]


def test_bench_cli_base_url_with_v1_and_wrong_url(
    target: tuple[Proc, Proc], tmp_path: Path
) -> None:
    """The SDK-style base URL works; a wrong one fails fast, with few requests (backoff), an
    error column by status, and exit 1 with the reason."""
    _e, g = target

    def bench(url: str, out: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "unbroken",
                "bench",
                "--url",
                url,
                "--users",
                "10",
                "--duration",
                "3",
                "--max-tokens",
                "8:16",
                "--out",
                str(out),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )

    good = bench(g.url + "/v1/", tmp_path / "good")
    assert good.returncode == 0, good.stderr
    data = json.loads((tmp_path / "good" / "results.json").read_text())
    assert data["records"] and {r["outcome"] for r in data["records"]} == {"ok"}
    bad = bench(g.url + "/v2", tmp_path / "bad")
    assert bad.returncode == 1, bad.stderr
    assert "no request succeeded" in bad.stderr and "HTTP 404" in bad.stderr
    data = json.loads((tmp_path / "bad" / "results.json").read_text())
    # 10 users backing off from 0.1 s doubling: a handful each in 3 s, not thousands.
    assert 10 <= len(data["records"]) <= 120
    assert data["windows"]["whole run"]["errors"] == {"HTTP 404": len(data["records"])}
    assert data["checks"][0]["ok"] is False


def test_locustfile_reports_ttft_and_itl(target: tuple[Proc, Proc], tmp_path: Path) -> None:
    """Locust's rows mean what they say: the request row is the whole stream (longer than
    its TTFT by the decode time of its tokens), TTFT has one entry per request, and ITL is
    not a Locust entry (it would swamp the totals) but a table and `_itl.csv`."""
    import csv
    import shutil

    locust = shutil.which("locust", path=str(Path(sys.executable).parent))
    if locust is None:
        pytest.skip("locust is not installed (it is in the dev extras: pip install -e .[dev])")
    _e, g = target
    root = Path(__file__).parent.parent
    r = subprocess.run(
        [
            locust,
            "-f",
            str(root / "benchmarks" / "locustfile.py"),
            "--headless",
            "--host",
            g.url + "/v1",
            "--users",
            "5",
            "--spawn-rate",
            "5",
            "--run-time",
            "4s",
            "--csv",
            str(tmp_path / "lc"),
            "--only-summary",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**__import__("os").environ, "UNBROKEN_MAX_TOKENS": "32"},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    with open(tmp_path / "lc_stats.csv") as f:
        rows = {row["Name"]: row for row in csv.DictReader(f)}
    stream, ttft = rows["/v1/chat/completions (stream)"], rows["TTFT"]
    assert int(stream["Request Count"]) > 0 and int(stream["Failure Count"]) == 0
    assert abs(int(ttft["Request Count"]) - int(stream["Request Count"])) <= 5
    assert "ITL" not in rows
    # 31 gaps of ~4 ms after the first token: the stream takes well over its TTFT.
    assert float(stream["Median Response Time"]) > float(ttft["Median Response Time"]) + 50
    with open(tmp_path / "lc_itl.csv") as f:
        itl = {row["Name"]: row for row in csv.DictReader(f)}
    gaps, tpot = itl["ITL (every gap)"], itl["TPOT (mean gap per request)"]
    # (up to 5 streams are cut short when the run stops)
    assert int(gaps["Count"]) >= 31 * (int(tpot["Count"]) - 5) > 0
    assert 1 < float(gaps["p50 (ms)"]) < 100
    assert "ITL (every gap)" in r.stdout + r.stderr


def test_bench_chaos_scenario_against_a_pipeline(tmp_path: Path) -> None:
    from helpers import small_up

    u = small_up(tmp_path)
    try:
        out = tmp_path / "out"
        r = u.run(
            "bench",
            "--scenario",
            "chaos",
            "--users",
            "12",
            "--duration",
            "9",
            "--at",
            "3",
            "--max-tokens",
            "40:80",
            "--out",
            str(out),
        )
        assert r.returncode == 0, r.stderr
        data = json.loads((out / "results.json").read_text())
        kinds = [e["event"] for e in data["events"]]
        assert kinds == ["replica_killed", "replica_replaced"]
        assert data["meta"]["pipeline"] == "primary: 2 x fp16"  # the report's metadata
        assert data["meta"]["command"].startswith("unbroken bench --scenario chaos")
        chaos = data["windows"]["chaos"]
        assert chaos["open"]["streams"] > 0 and chaos["open"]["dropped"] == 0
        assert chaos["open"]["corrupted"] == 0
        # No --engine-metrics: the pipeline's own engines are read (the hit rate and the
        # spread were "not measured" against the very pipeline whose engines it knows).
        assert "(the running pipeline's; --engine-metrics to name others)" in r.stderr
        # Followed through the chaos: the killed engine up to its last reading, the
        # survivor, and the replacement from its start (none "unreadable").
        engs = data["engines"]["engines"]
        assert len(engs) == 3 and not any("error" in e for e in engs.values()), engs
        assert all(e["requests"] > 0 for e in engs.values()), engs
    finally:
        u.stop()


def test_demo_help_warns_that_short_windows_make_the_ratio_checks_unreliable() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "unbroken", "demo", "--help"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**__import__("os").environ, "COLUMNS": "200"},
    )
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert "the p99.9 is the window's one slowest request" in text
    assert "make the ratio checks unreliable" in text


@given(st.integers(min_value=1, max_value=20_000))
def test_rank_note_names_the_request_the_p999_is(n: int) -> None:
    """The demo says which request its p99.9 is (the slowest of fewer than 1,000): the same
    one `percentile` picks."""
    xs = [float(i) for i in range(n)]  # the k-th slowest is n - k
    k = n - int(percentile(xs, 99.9) or 0)
    note = rank_note(n)
    assert note.endswith(f" of {n}")
    assert note.startswith("the slowest" if k == 1 else f"the {k}")
