"""Day-2 operation of `unbroken up` (an SRE review, /tmp/review-sre/findings.md): a planned
stop, SIGHUP, a hung engine, a pool in a crash loop, and what the supervisor logs. Real
`unbroken up` processes, each with its own state directory and ports."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from helpers import MODEL, Up, stream, wait_for


def _spec(tmp: Path, pools: str, extra: str = "") -> Path:
    p = tmp / "spec.yaml"
    p.write_text(f"model: {MODEL}\npools:\n{pools}controller: {{enabled: false}}\n{extra}")
    return p


def _error(events: list[Any]) -> dict[str, Any] | None:
    return next((e["error"] for e in events if isinstance(e, dict) and "error" in e), None)


def _finish(events: list[Any]) -> str | None:
    for e in events:
        if isinstance(e, dict):
            for ch in e.get("choices", []):
                if ch.get("finish_reason"):
                    return str(ch["finish_reason"])
    return None


def test_down_drains_the_gateway_first_and_honours_the_engines_shutdown_timeout(
    tmp_path: Path,
) -> None:
    """`unbroken down` SIGTERMed the engines first and SIGKILLed them after a literal 10 s:
    the gateway's open streams ended `stream_broken` (counted dropped) although the engine
    announced 30 s. Now the gateway stops first (its streams finish or end with its
    `shutdown` event), then each engine gets its pool's `shutdown_timeout_s` (here 13 s,
    over the old 10) before any SIGKILL."""
    spec = _spec(
        tmp_path,
        "  - name: main\n    replicas: 1\n    weights_size: 8MiB\n"
        "    engine: {shutdown_timeout_s: 13, overrides: {decode_base_s: 0.02}}\n",
    )
    u = Up(tmp_path, spec)
    try:
        engine_url = next(r["url"] for r in u.status()["replicas"])
        got: dict[str, tuple[list[Any], int]] = {}

        def one(key: str, url: str, tokens: int) -> None:
            body = {"model": MODEL, "prompt": key, "max_tokens": tokens, "temperature": 0}
            try:
                events, r = stream(url, "/v1/completions", body, timeout=90)
                got[key] = events, r.status_code
            except httpx.HTTPError as e:  # a cut connection: what must not happen via the gateway
                got[key] = [type(e).__name__], -1

        jobs = {f"long {i}": (u.url, 3000) for i in range(3)}
        jobs["short"] = (u.url, 120)  # finishes within the gateway's drain
        jobs["direct"] = (engine_url, 3000)  # held by the engine itself at its SIGTERM
        threads = [threading.Thread(target=one, args=(k, *v)) for k, v in jobs.items()]
        for t in threads:
            t.start()
        time.sleep(1.0)
        t0 = time.monotonic()
        down = u.run("down", timeout=120)
        took = time.monotonic() - t0
        for t in threads:
            t.join(90)
        assert down.returncode == 0, down.stdout + down.stderr
        for i in range(3):
            events, code = got[f"long {i}"]
            assert code == 200, (i, events[-3:])
            err = _error(events)
            assert err is not None and err["code"] == "shutdown", (i, err)
            assert events[-1] == "[DONE]", events[-3:]
        events, code = got["short"]
        assert code == 200 and _error(events) is None and _finish(events) == "length", events[-3:]
        # The engine drained for its own 13 s and exited by itself: never SIGKILLed.
        logs = u.state / "logs"
        engine_log = (logs / "main-1.log").read_text()
        assert "waiting up to 13 s" in engine_log and "engine stopped" in engine_log, engine_log[
            -800:
        ]
        up_log = u.log.read_text()
        assert "killed" not in up_log, up_log[-2000:]
        assert took > 13, took  # the gateway's drain (8 s), then the engine's 13 s
        # `down` says how long it may take: the gateway's drain, then the engines' timeout.
        assert "the gateway drains its streams, then the engines finish theirs; up to" in (
            down.stdout
        ), down.stdout
    finally:
        u.kill_orphans()


def test_sighup_reloads_and_is_logged(tmp_path: Path) -> None:
    """SIGHUP to `unbroken up` (a closed terminal, systemd's ExecReload) killed the supervisor
    without a line. Now it reloads the spec, the path of `unbroken reload`, and says so; a
    spec that does not validate is refused and logged, and the supervisor goes on."""
    pool = "  - name: main\n    replicas: 1\n    weights_size: 8MiB\n    cap: {cap}\n"
    spec = _spec(tmp_path, pool.format(cap=64))
    u = Up(tmp_path, spec)
    try:

        def cap() -> int:
            return int(u.status()["gateway"]["endpoints"][0]["cap"])

        assert cap() == 64
        spec.write_text(spec.read_text().replace("cap: 64", "cap: 7"))
        os.kill(u.proc.pid, signal.SIGHUP)
        wait_for(lambda: cap() == 7, timeout=30, interval=0.3, what="the cap reloaded")
        spec.write_text(spec.read_text().replace("cap: 7", "cap: -1"))
        os.kill(u.proc.pid, signal.SIGHUP)
        wait_for(
            lambda: "reload (SIGHUP) refused, nothing changed" in u.log.read_text(),
            timeout=30,
            interval=0.3,
            what=lambda: u.log.read_text()[-1500:],
        )
        assert u.proc.poll() is None
        log = u.log.read_text()
        assert "SIGHUP: reloading the spec" in log and "gateway reloaded (generation" in log
        assert "pools.0.cap" in log, log[-1500:]
        assert cap() == 7
        assert u.stop() == 0
    finally:
        u.kill_orphans()


def test_liveness_numbers_are_the_rendered_probes() -> None:
    """The local liveness check uses the numbers of the livenessProbe `unbroken render k8s`
    gives engines, so a hung engine heals alike under `unbroken up` and on a cluster."""
    from unbroken.config.spec import LIVENESS_FAILURES, default_spec
    from unbroken.k8s import RenderOptions
    from unbroken.k8s.manifests import build

    spec = default_spec()
    spec.pools[1].engine.liveness_period_s = 3  # one pool's own period, and its timeout
    probes = {
        o["metadata"]["name"]: c["livenessProbe"]
        for o in build(spec, RenderOptions())
        if o["kind"] == "Deployment"
        for c in o["spec"]["template"]["spec"]["containers"]
        if c["name"] == "engine"
    }
    assert len(probes) == 2, probes
    for pool in spec.pools:
        p = next(v for k, v in probes.items() if k.endswith(pool.name))
        assert p["httpGet"]["path"] == "/health"
        assert p["periodSeconds"] == pool.engine.liveness_period_s
        assert p["timeoutSeconds"] == pool.engine.liveness_timeout_s
        assert p["failureThreshold"] == LIVENESS_FAILURES
    assert spec.pools[0].engine.liveness_timeout_s == 5  # the default: every 10 s, 5 s each
    assert spec.pools[1].engine.liveness_timeout_s == 3


def test_a_hung_engine_is_not_live_and_is_replaced(tmp_path: Path) -> None:
    """A SIGSTOPped engine was never replaced, and `status` counted it live (the docs: live
    = answers /health). Now it stops counting at its first failed check, and after 3 in a row
    (every `engine.liveness_period_s`, 10 s by default and 2 s here, as the rendered
    livenessProbe) it is killed and replaced, with a WARNING
    that says why. The other replica, busy with streams meanwhile, is left alone."""
    spec = _spec(
        tmp_path,
        "  - name: main\n    replicas: 2\n    weights_size: 8MiB\n"
        "    engine: {overrides: {decode_base_s: 0.01}, liveness_period_s: 2}\n",
    )
    u = Up(tmp_path, spec)
    try:
        pids = {r["name"]: r["pid"] for r in u.status()["replicas"]}
        stop = threading.Event()

        def load() -> None:  # keeps the other replica busy
            body = {"model": MODEL, "prompt": "busy", "max_tokens": 200}
            with httpx.Client(timeout=30) as c:
                while not stop.is_set():
                    with contextlib.suppress(httpx.HTTPError):
                        c.post(u.url + "/v1/completions", json=body)

        workers = [threading.Thread(target=load, daemon=True) for _ in range(4)]
        for w in workers:
            w.start()
        os.kill(pids["main-1"], signal.SIGSTOP)
        try:
            wait_for(
                lambda: u.status()["pools"]["main"]["live"] == 1,
                timeout=25,
                interval=0.5,
                what="the hung replica no longer live",
            )
            st = u.status()
            hung = next(r for r in st["replicas"] if r["name"] == "main-1")
            assert hung["state"] == "not answering", hung
            wait_for(
                lambda: "main-1" not in {r["name"] for r in u.status()["replicas"]},
                timeout=40,
                interval=0.5,
                what="the hung replica killed",
            )
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pids["main-1"], signal.SIGCONT)
        wait_for(
            lambda: u.status()["pools"]["main"]["live"] == 2,
            timeout=40,
            interval=0.5,
            what="a replacement live",
        )
        stop.set()
        for w in workers:
            w.join(30)
        log = u.log.read_text()
        assert "main-1 (pid" in log and "failed its liveness check 3 times in a row" in log, log
        names = {r["name"] for r in u.status()["replicas"]}
        assert "main-2" in names and len(names) == 2, names  # the busy one was not killed
        events = [e for e in u.status()["events"] if e["event"] == "replica_hung"]
        assert [e["replica"] for e in events] == ["main-1"], events
        assert u.stop() == 0
    finally:
        u.kill_orphans()


def test_crash_loop_status_rollout_output_and_the_supervisor_log(tmp_path: Path) -> None:
    """A pool whose only replica is in a replacement crash loop vanished from the status
    table; `restarts: N` on the gateway's line counted replica replacements; "X serves: CPU
    quota lifted" was logged for replicas that never served; a rollout that failed before
    its new replica had a name printed `rolling back None`, and one with a command engine a
    dict with a simulator `profile`; rollouts were not in the supervisor's log, which went
    only to `up`'s output, not to STATE/logs."""
    flag = tmp_path / "fail"
    script = tmp_path / "eng.sh"
    script.write_text(
        "#!/bin/sh\n"
        f'[ -e {flag} ] && {{ echo "eng.sh: refusing to start" >&2; exit 7; }}\n'
        f'exec {sys.executable} -m unbroken engine --host 127.0.0.1 --port "$1" '
        f"--served-model-name {MODEL} --profile fp8\n"
    )
    script.chmod(0o755)
    spec = _spec(
        tmp_path,
        "  - name: main\n    replicas: 1\n    weights_size: 8MiB\n"
        "  - name: side\n    replicas: 1\n"
        f"    engine: {{kind: command, command: [{script}, '{{port}}']}}\n",
    )
    u = Up(tmp_path, spec)
    try:
        ro = u.run("rollout", "side", "--command", "/nonexistent/vllm {port}", timeout=60)
        assert ro.returncode == 1, ro.stdout + ro.stderr
        out = " ".join((ro.stdout + ro.stderr).split())
        assert "replacing 1 replica(s) with command: /nonexistent/vllm" in out, out
        assert "rolling back (no new replica had started)" in out, out
        assert "None" not in out and "profile" not in out, out

        flag.touch()
        side = next(r for r in u.status()["replicas"] if r["pool"] == "side")
        os.kill(side["pid"], signal.SIGKILL)
        st = wait_for(
            lambda: (
                (s := u.status())["replacing"].get(side["name"], "starting") != "starting" and s
            ),
            timeout=30,
            interval=0.3,
            what="a failed replacement",
        )
        assert st["pools"]["side"]["live"] == 0
        text = u.run("status", timeout=30)
        assert text.returncode == 0, text.stderr
        rows = [line.split() for line in text.stdout.splitlines()]
        assert any(r[:5] == ["side", "-", "-", "-", "replacing"] for r in rows), text.stdout
        line = next(x for x in text.stdout.splitlines() if x.startswith("pool side:"))
        assert line.startswith(f"pool side: 0/1 live, 1 missing; replacing {side['name']}, "), line
        assert "exited with 7 before answering /health" in line, line
        assert "pool main: 1/1 live" in text.stdout
        assert "gateway restarts: 0" in text.stdout, text.stdout
        assert "replica replacements: " in text.stdout and " failed" in text.stdout
        assert "restarts: " not in text.stdout.replace("gateway restarts: ", "")

        flag.unlink()
        wait_for(
            lambda: u.status()["pools"]["side"]["live"] == 1,
            timeout=60,
            interval=0.5,
            what="the crash loop over",
        )
        assert u.stop() == 0
        log = (u.state / "logs" / "supervisor.log").read_text()
        assert (u.state / "logs" / "supervisor.log").stat().st_mode & 0o077 == 0
        assert "rollout of side: replacing 1 replica(s) with command: /nonexistent/vllm" in log
        assert "WARNING unbroken.pipeline: rollout of side: rolling back" in log, log
        assert "WARNING unbroken.pipeline: rollout of side stopped after" in log, log
        assert f"could not replace {side['name']} (attempt 1)" in log, log
        assert "stopping: the gateway drains its streams" in log and "stopped in" in log
        # Only replicas that served are said to serve; a failed try "stopped before serving"
        # (where cgroups give a startup CPU quota, as on this test's machines).
        for n in range(3, 12):
            name = f"side-{n}"
            if f"{name} exited with 7" in log:
                assert f"{name} serves: CPU quota lifted" not in log, name
                if f"{name} starts under a CPU quota" in log:
                    assert f"{name} stopped before serving: its startup CPU quota removed" in log
    finally:
        u.kill_orphans()


def test_a_start_error_shows_this_starts_log_lines_only(tmp_path: Path) -> None:
    """gateway.log is appended to across starts: a failed start printed its last lines,
    which held an earlier start's errors (a port since fixed, reported again as in use)."""
    from unbroken.pipeline.procs import log_size, tail

    log = tmp_path / "gateway.log"
    log.write_text("error: cannot listen on 127.0.0.1:18080: the port is already in use\n")
    since = log_size(log)
    with open(log, "a") as f:
        f.write("error: cannot listen on 127.0.0.1:18081: the port is already in use\n")
    assert tail(log, since=since) == (
        "error: cannot listen on 127.0.0.1:18081: the port is already in use"
    )
    assert "18080" in tail(log) and tail(tmp_path / "none.log") == ""
    assert log_size(tmp_path / "none.log") == 0


def test_a_process_started_through_a_script_is_still_recognised(tmp_path: Path) -> None:
    """A command engine started by a wrapper that `exec`s (or a shebang script: vLLM's
    `vllm`) runs with another command line than recorded; adoption compared the command
    line too and left such an engine running past `unbroken down` (a review as an SRE).
    The pid and its start time name the process; a pid reused later does not match."""
    import subprocess

    from unbroken.pipeline.procs import Adopted, proc_start_time

    script = tmp_path / "eng.sh"
    script.write_text("#!/bin/sh\nexec sleep 60\n")
    script.chmod(0o755)
    p = subprocess.Popen([str(script)], start_new_session=True)
    try:
        rec = {"pid": p.pid, "start": proc_start_time(p.pid), "argv": [str(script)]}
        deadline = time.monotonic() + 5
        while Path(f"/proc/{p.pid}/cmdline").read_bytes().split(b"\0")[0] != b"sleep":
            assert time.monotonic() < deadline, "the script did not exec"
            time.sleep(0.02)
        adopted = Adopted.verify(rec)
        assert adopted is not None and adopted.pid == p.pid
        adopted.release()
        assert Adopted.verify({**rec, "start": rec["start"] - 1}) is None  # another process
        assert Adopted.verify({"pid": p.pid, "argv": [str(script)]}) is None  # no start time
    finally:
        p.kill()
        p.wait()


def test_a_name_given_in_the_state_directory_is_not_given_again(tmp_path: Path) -> None:
    """Replicas of an earlier supervisor left their logs: a new one's first replica took
    `fallback-1` again and appended to that log, and the gateway's metrics labelled with it
    ran on across two processes (a review as an SRE)."""
    import types

    from unbroken.config.spec import default_spec
    from unbroken.pipeline.replicas import ReplicaSet

    logs = tmp_path / "logs"
    logs.mkdir()
    for name in ("primary-1", "primary-4", "fallback-2", "gateway", "supervisor"):
        (logs / f"{name}.log").write_text("")
    rs = ReplicaSet(types.SimpleNamespace(spec=default_spec(), logs=logs))  # type: ignore[arg-type]
    assert next(rs._serial["primary"]) == 5 and next(rs._serial["fallback"]) == 3
    fresh = ReplicaSet(types.SimpleNamespace(spec=default_spec(), logs=tmp_path / "none"))  # type: ignore[arg-type]
    assert next(fresh._serial["primary"]) == 1
