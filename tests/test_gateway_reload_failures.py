"""A gateway's workers that cannot start (real gateway processes, `--workers 2`): a refused
reload leaves the gateway exactly as it was (settings, caps, workers: none replaced, none
counted as serving that does not), the next reload starts afresh, and workers that die as
soon as they start are replaced with a growing back-off, not in a tight loop.

"Code on disk that no longer starts" is a `sitecustomize` on the gateway's PYTHONPATH that
ends every worker process (UNBROKEN_GW_WORKER set) while a flag file exists; the main
process is untouched. (The reviewer's case, a `redis_url` of the wrong scheme, is refused
when the spec is read now: `test_spec_names.py`, `test_up_reload.py`.)"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx

from helpers import MODEL, Proc, admin, engine, gateway, metric, wait_for
from test_gateway_workers import workers_of

SITECUSTOMIZE = """
import os, sys
if os.environ.get("UNBROKEN_GW_WORKER") and os.path.exists({flag!r}):
    sys.stderr.write("test: this worker's code is broken\\n")
    os._exit(1)
"""


def broken_gateway(tmp: Path, endpoint: str, cfg: Path) -> tuple[Proc, Path]:
    """A gateway of 2 workers on `cfg`, whose new workers die at start while the returned
    flag file exists."""
    flag = tmp / "workers-broken"
    site = tmp / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE.format(flag=str(flag)))
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    g = gateway(
        tmp,
        endpoint,
        args=("--workers", "2", "--config", str(cfg)),
        env={"PYTHONPATH": path},
    )
    wait_for(lambda: workers_of(g)["serving"] == 2, timeout=30, what="both workers serving")
    return g, flag


def cap(g: Proc) -> int:
    return int(admin(g, "GET", "/admin/endpoints").json()["endpoints"][0]["cap"])


def ask(g: Proc) -> httpx.Response:
    body = {"model": MODEL, "prompt": "still here", "max_tokens": 3}
    return httpx.post(g.url + "/v1/completions", json=body, timeout=30)


def test_a_refused_reload_changes_nothing_and_the_next_one_starts_afresh(tmp_path: Path) -> None:
    """New workers that die at start: the reload is refused and nothing of it stays. It
    used to apply the new settings to the main process first and keep them (the default cap
    here), replace the dead new workers with those settings, for ever (~2 a second, each
    counted as serving), and refuse every later reload (its settings file stayed)."""
    e = engine(tmp_path)
    cfg = tmp_path / "gw.yaml"
    cfg.write_text("default_cap: 5\n")
    g, flag = broken_gateway(tmp_path, e.url, cfg)
    try:
        before = workers_of(g)
        assert before["serving"] == 2 and before["generation"] == 0 and cap(g) == 5
        assert "x-unbroken-endpoint" in ask(g).headers

        cfg.write_text("default_cap: 3\nendpoint_header: false\n")
        flag.touch()
        g.signal(signal.SIGHUP)
        wait_for(lambda: workers_of(g)["last_reload_error"], timeout=40, what=lambda: g.tail())
        assert "did not start serving" in workers_of(g)["last_reload_error"]
        time.sleep(3.0)  # a crash loop shows within this
        ws = workers_of(g)
        assert ws["generation"] == 0 and ws["pids"] == before["pids"], ws
        assert ws["serving"] == 2 and ws["starting"] == 0, ws
        log = g.tail(400)
        assert "replacing it" not in log and "crash-looping" not in log, log
        assert metric(g.url, "unbroken_gateway_worker_restarts_total", kind="replaced") == 0
        assert metric(g.url, "unbroken_gateway_workers", state="serving") == 2
        assert cap(g) == 5  # the refused settings are not the gateway's
        r = ask(g)
        assert r.status_code == 200 and "x-unbroken-endpoint" in r.headers

        # Fixed code and settings: the next reload (the same generation number) serves.
        flag.unlink()
        cfg.write_text("default_cap: 4\n")
        g.signal(signal.SIGHUP)
        ws = wait_for(
            lambda: (w := workers_of(g))["generation"] == 1 and w["draining"] == 0 and w,
            timeout=40,
            what=lambda: g.tail(),
        )
        assert ws["serving"] == 2 and ws["last_reload_error"] is None
        assert cap(g) == 4
        r = ask(g)
        assert r.status_code == 200 and "x-unbroken-endpoint" in r.headers
    finally:
        g.stop()
        e.stop()


def test_workers_that_die_at_start_are_replaced_with_a_back_off(tmp_path: Path) -> None:
    """A worker killed while its replacements cannot start: they are replaced after a
    growing back-off (a handful of deaths in 6 s, not one every half second), the crash
    loop is logged once, /admin/status does not count a starting worker as serving, and
    once workers start again the gateway has its 2 serving workers back."""
    e = engine(tmp_path)
    cfg = tmp_path / "gw.yaml"
    cfg.write_text("queue_timeout_s: 10\n")
    g, flag = broken_gateway(tmp_path, e.url, cfg)
    try:
        victim = workers_of(g)["pids"][0]
        flag.touch()
        t0 = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        time.sleep(6.0)
        log = g.tail(2000)
        # Replacements started at +0, +0.5, +1.5, +3.5 s (a tight loop: dozens).
        started = metric(g.url, "unbroken_gateway_worker_restarts_total", kind="replaced")
        assert 3 <= started <= 6, log
        assert log.count("crash-looping") == 1, log
        ws = workers_of(g)
        assert ws["serving"] == 1 and victim not in ws["pids"], ws
        assert ask(g).status_code == 200  # the other worker serves meanwhile

        flag.unlink()
        ws = wait_for(
            lambda: (w := workers_of(g))["serving"] == 2 and w,
            timeout=40,
            what=lambda: g.tail(),
        )
        assert ws["starting"] == 0
        took = time.monotonic() - t0
        print(f"{started:.0f} replacements in 6 s; 2 serving again after {took:.1f} s")
        wait_for(lambda: "workers start again" in g.tail(400), timeout=20, what=lambda: g.tail())
    finally:
        g.stop()
        e.stop()
