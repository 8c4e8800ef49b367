"""The demo's verdict says why (issue 21, finding 8): every check is printed with its
verdict, the reason is on the last line, and tables are printed whole into a pipe."""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table

from unbroken.bench.demo import print_table, print_verdict

RESULTS = {
    "checks": [
        {
            "metric": "dropped SSE streams during contention",
            "measured": "0",
            "target": "0",
            "ok": True,
        },
        {
            "metric": "p99.9 TTFT, during rolling upgrade",
            "measured": "235.4 ms (1.85x steady; 3rd slowest of 2112 first tokens)",
            "target": "<= 1.5x steady",
            "ok": False,
            "reason": "p99.9 TTFT during the rolling upgrade 235.4 ms is 1.85x steady "
            "(target <= 1.5x)",
        },
        {
            "metric": "rolling upgrade of primary (2 replicas)",
            "measured": "21.0 s, ok",
            "target": "ok",
            "ok": True,
        },
    ]
}


def _pipe() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, soft_wrap=True, force_terminal=False, width=80), buf


def test_fail_prints_every_check_and_the_reason_last() -> None:
    console, buf = _pipe()
    assert print_verdict(console, RESULTS) is False
    out = buf.getvalue()
    for c in RESULTS["checks"]:
        assert c["metric"] in out and c["measured"] in out
    assert out.count("FAIL") >= 2  # the failing row and the last line
    last = out.rstrip("\n").splitlines()[-1]
    assert last == (
        "FAIL (1 of 3 checks): p99.9 TTFT during the rolling upgrade 235.4 ms is 1.85x "
        "steady (target <= 1.5x)"
    )


def test_a_check_without_its_own_reason_names_measured_and_target() -> None:
    console, buf = _pipe()
    res = {
        "checks": [
            {"metric": "failed_requests", "measured": "3 requests", "target": "0", "ok": False}
        ]
    }
    assert print_verdict(console, res) is False
    last = buf.getvalue().rstrip("\n").splitlines()[-1]
    assert last == "FAIL (1 of 1 checks): failed_requests: 3 requests (target 0)"


def test_pass_is_the_last_line() -> None:
    console, buf = _pipe()
    res = {"checks": [c | {"ok": True} for c in RESULTS["checks"]]}
    assert print_verdict(console, res) is True
    assert buf.getvalue().rstrip("\n").splitlines()[-1] == "PASS: all 3 checks"


def test_tables_are_not_cut_into_a_pipe() -> None:
    console, buf = _pipe()
    t = Table()
    for c in ("metric", "standard", "unbroken", "unit", "target"):
        t.add_column(c)
    long = "p999_ttft_ms_under_contention_against_steady_state_with_a_long_name"
    t.add_row(long, "1234.5", "234.5", "ms", "<= 1.5x steady of the unbroken pass, measured")
    print_table(console, t)
    out = buf.getvalue()
    assert long in out and "<= 1.5x steady of the unbroken pass, measured" in out
    assert "…" not in out
