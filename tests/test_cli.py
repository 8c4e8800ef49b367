"""The CLI as a new user meets it: help that keeps its text, --version and -h, `status` that
never cuts a name (piped, or in an 80-column terminal), `status --json` with nothing
running, one-line errors for a port in use, a gateway that says it has no endpoints, a
rollout of a pool that does not exist, the admin token never printed, and the Prometheus
file_sd targets that `unbroken up` keeps current across a rollout."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import shutil
import socket
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from helpers import TOKEN, Proc, Up, admin, small_up, wait_for
from unbroken import __version__
from unbroken.pipeline.up import STATUS_COLUMNS, render_table
from unbroken.wire.http import free_port


def cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "unbroken", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def _flat(text: str) -> str:
    """Help text with click's line wrapping undone."""
    return re.sub(r"\s*\n\s*", " ", text).replace("- ", "-")


def test_version_and_short_help() -> None:
    r = cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"unbroken {__version__}"
    for args in (("-h",), ("status", "-h"), ("weights", "make", "-h")):
        r = cli(*args)
        assert r.returncode == 0 and "Usage:" in r.stdout, args


def test_help_keeps_brackets_and_option_names_at_80_columns() -> None:
    env = {"COLUMNS": "80"}
    gw = cli("gateway", "-h", env=env).stdout
    assert "[x-unbroken-priority]" in _flat(gw) and "[8080]" in gw
    eng = cli("engine", "-h", env=env).stdout
    assert "--served-model-name, --model" in eng
    for cmd in ("engine", "gateway", "agent", "bench", "up", "rollout"):
        text = cli(cmd, "-h", env=env).stdout
        assert "--no-no-" not in text and "…" not in text, cmd
        assert max(len(line) for line in text.splitlines()) <= 80, cmd
    assert "--no-warmup " in gw and "--no-cuda-stub " in eng
    assert "--no-ebpf " in cli("agent", "-h", env=env).stdout


def test_status_with_nothing_running(tmp_path: Path) -> None:
    env = {"UNBROKEN_STATE_DIR": str(tmp_path / "empty")}
    r = cli("status", "--json", env=env)
    assert r.returncode == 1
    assert json.loads(r.stdout)["running"] is False
    r = cli("status", env=env)
    assert r.returncode == 1 and "no pipeline is running" in r.stderr and r.stdout == ""


def test_commands_with_nothing_running_say_where(tmp_path: Path) -> None:
    """`unbroken drain` with no pipeline said only `no admin token: set
    UNBROKEN_ADMIN_TOKEN`; it names the state directory and --token-file. `reload`,
    `rollout` and `scale` name the directory too."""
    env = {"UNBROKEN_STATE_DIR": str(tmp_path / "empty")}
    r = cli("drain", "primary-2", env=env)
    said = " ".join(r.stderr.split())
    assert r.returncode == 2, said
    assert f"no pipeline runs in the state directory {tmp_path / 'empty'}" in said, said
    assert "UNBROKEN_ADMIN_TOKEN" in said and "--token-file" in said, said
    for argv in (["reload"], ["rollout", "primary"], ["scale", "primary", "2"]):
        r = cli(*argv, env=env)
        said = " ".join(r.stderr.split())
        assert r.returncode != 0, argv
        assert f"no pipeline is running in {tmp_path / 'empty'}" in said, (argv, said)
    # A negative count is a range error of the argument, not "No such option: -1".
    r = cli("scale", "primary", "-1", env=env)
    said = " ".join(r.stderr.split())
    assert r.returncode == 2 and "greater than or equal to 0" in said, said
    assert "No such option" not in said, said


def test_status_table_never_cuts_names() -> None:
    rows = [
        {
            "pool": "primary",
            "endpoint": f"primary-fp16-replica-{i}",
            "url": f"http://10.0.12.{i}:8000",
            "pid": "123456",
            "state": "ready",
            "condition": "contended",
            "healthy": "yes",
            "in-flight": "12/256",
            "start→health": "1.23 s",
        }
        for i in range(3)
    ]
    piped = render_table(rows, STATUS_COLUMNS, None)
    assert all(c in piped.splitlines()[0] for c in STATUS_COLUMNS)  # every column when piped
    narrow = render_table(rows, STATUS_COLUMNS, 80)
    lines = narrow.splitlines()
    assert max(map(len, lines)) <= 80
    for r in rows:  # whole names and URLs, on one line each
        assert any(r["endpoint"] in ln and r["url"] in ln for ln in lines)
    assert "state" in lines[0] and "in-flight" in lines[0]
    # Wider than any terminal: still nothing cut (columns dropped, names kept).
    tiny = render_table(rows, STATUS_COLUMNS, 20)
    assert all(r["url"] in tiny for r in rows)


@pytest.mark.parametrize("which", ["gateway", "agent", "engine"])
def test_port_in_use_is_one_line_and_exit_2(which: str, tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        args = {
            "gateway": ["gateway", "--port", str(port), "--admin-port", str(free_port())],
            "agent": ["agent", "--no-ebpf", "--listen", f"127.0.0.1:{port}"],
            "engine": ["engine", "--port", str(port)],  # was a 56-line traceback
        }[which]
        r = cli(*args, env={"UNBROKEN_STATE_DIR": str(tmp_path), "UNBROKEN_ADMIN_TOKEN": "t"})
    assert r.returncode == 2, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if "error" in ln.lower()]
    option = {"gateway": "--port / --admin-port", "agent": "--listen", "engine": "--port"}[which]
    assert len(errors) == 1 and errors[0].startswith(
        f"error: cannot listen on 127.0.0.1:{port}: the port is already in use "
        f"(another process listens there); choose another with {option}"
    ), errors
    assert "Traceback" not in r.stderr and "Unclosed" not in r.stderr


def test_gateway_without_endpoints_says_so(tmp_path: Path) -> None:
    port, admin_port = free_port(), free_port()
    g = Proc(
        [
            sys.executable,
            "-m",
            "unbroken",
            "gateway",
            "--port",
            str(port),
            "--admin-port",
            str(admin_port),
        ],
        port,
        tmp_path / "gw.log",
        env={"UNBROKEN_ADMIN_TOKEN": TOKEN, "UNBROKEN_STATE_DIR": str(tmp_path)},
        admin_port=admin_port,
    ).start()
    try:
        r = httpx.get(g.url + "/health", timeout=5)
        assert r.status_code == 200 and "no endpoints" in r.text
        # and a warning in the log, a few seconds after the start
        wait_for(lambda: "WARNING" in g.tail() and "no endpoints" in g.tail(), timeout=20)
        dead = f"http://127.0.0.1:{free_port()}"
        assert (
            admin(g, "POST", "/admin/endpoints", {"url": dead, "name": "nowhere"}).status_code < 300
        )
        text = httpx.get(g.url + "/health", timeout=5).text
        assert "no endpoint is ready" in text and "nowhere" in text
    finally:
        g.stop()


def _pty_run(args: list[str], env: dict[str, str], cols: int = 80) -> str:
    """Run with a terminal of `cols` columns as stdout; return what it printed."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, cols, 0, 0))
    env = {k: v for k, v in env.items() if k not in ("COLUMNS", "LINES")}
    p = subprocess.Popen(args, stdout=slave, stderr=subprocess.PIPE, env=env)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    p.wait(30)
    os.close(master)
    return out.decode().replace("\r\n", "\n")


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    u = small_up(tmp_path_factory.mktemp("cli-up"))
    yield u
    u.stop()


def test_status_piped_and_in_an_80_column_terminal(pipeline: Up) -> None:
    st = pipeline.status()
    assert st["running"] is True
    names = {r["name"]: r["url"] for r in st["replicas"]}
    assert set(names) == {"primary-1", "primary-2"}
    piped = pipeline.run("status")
    assert piped.returncode == 0, piped.stderr
    lines = piped.stdout.splitlines()
    assert lines[0].split() == [c for c in STATUS_COLUMNS]
    for name, url in names.items():  # `unbroken status | grep primary-1` finds the row
        (row,) = [ln for ln in lines if ln.startswith("primary ") and f" {name} " in ln]
        assert url in row and " ready " in row
    assert re.search(r"^queue: critical \d+, standard \d+, sheddable \d+$", piped.stdout, re.M)
    assert re.search(r"^controller: ", piped.stdout, re.M)
    assert "{" not in piped.stdout  # no Python dicts
    term = _pty_run([sys.executable, "-m", "unbroken", "status"], pipeline.env)
    tlines = [ln for ln in term.splitlines() if ln.strip()]
    table = tlines[: len(names) + 1]
    assert max(len(ln) for ln in table) <= 80, term
    for name, url in names.items():
        assert any(name in ln and url in ln for ln in table), term


def test_rollout_of_a_missing_pool_says_why_only(pipeline: Up) -> None:
    r = pipeline.run("rollout", "nosuchpool")
    assert r.returncode == 1
    out = r.stdout + r.stderr
    assert "no pool named 'nosuchpool'" in out
    assert "rolled back" not in out and "old" not in out  # no empty table, no false story


def test_admin_token_is_not_printed(pipeline: Up) -> None:
    token = Path(pipeline.status()["admin_url"] and pipeline.state / "admin-token").read_text()
    token = token.strip()
    assert len(token) > 10
    assert token not in pipeline.log.read_text()
    assert "admin-token" in pipeline.log.read_text()  # where it is, instead
    for log in (pipeline.state / "logs").glob("*.log"):
        assert token not in log.read_text(errors="replace"), log


def _targets(pipeline: Up, job: str) -> list[str]:
    path = pipeline.state / "prometheus" / f"{job}.json"
    return [t for g in json.loads(path.read_text()) for t in g["targets"]]


def test_prometheus_targets_follow_a_rollout(pipeline: Up) -> None:
    wait_for(lambda: (pipeline.state / "prometheus" / "engines.json").exists(), timeout=10)
    st = pipeline.status()
    ports = {r["url"].rsplit(":", 1)[1] for r in st["replicas"]}
    assert {t.rsplit(":", 1)[1] for t in _targets(pipeline, "engines")} == ports
    assert _targets(pipeline, "gateway") == [f"127.0.0.1:{pipeline.port}"]
    assert _targets(pipeline, "controller") == [f"127.0.0.1:{pipeline.controller_port}"]
    assert _targets(pipeline, "agent") == []  # not started in this test (--no-agent)
    groups = json.loads((pipeline.state / "prometheus" / "engines.json").read_text())
    assert {g["labels"]["endpoint"] for g in groups} == {r["name"] for r in st["replicas"]}
    r = pipeline.run("rollout", "primary", "--deadline", "1", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    new = {r["url"].rsplit(":", 1)[1] for r in pipeline.status()["replicas"]}
    assert new.isdisjoint(ports)

    def current() -> bool:
        return {t.rsplit(":", 1)[1] for t in _targets(pipeline, "engines")} == new

    wait_for(current, timeout=5, what="targets rewritten after the rollout")
    # Every target answers /metrics (what Prometheus will scrape).
    for t in _targets(pipeline, "engines") + _targets(pipeline, "gateway"):
        assert httpx.get(f"http://{t}/metrics", timeout=5).status_code == 200
    time.sleep(0)


PROMETHEUS = shutil.which("prometheus")


@pytest.mark.skipif(
    PROMETHEUS is None, reason="prometheus not installed (apt-get install prometheus)"
)
def test_real_prometheus_scrapes_the_file_sd_targets(pipeline: Up, tmp_path: Path) -> None:
    """Debian's Prometheus with docs/prometheus.md's config: every target up, build_info from
    each component, the recording rules loaded."""
    rules = Path(__file__).parent.parent / "deploy" / "prometheus" / "recording-rules.yaml"
    prom = pipeline.state / "prometheus"
    jobs = ("gateway", "engines", "agent", "controller")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(rules)],
        "scrape_configs": [
            {"job_name": f"unbroken-{j}", "file_sd_configs": [{"files": [str(prom / f"{j}.json")]}]}
            for j in jobs
        ],
    }
    (tmp_path / "prometheus.yml").write_text(json.dumps(config))  # YAML is a superset of JSON
    port = free_port()
    assert PROMETHEUS is not None
    with open(tmp_path / "prometheus.log", "wb") as log:
        proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,
        )
    api = f"http://127.0.0.1:{port}/api/v1"
    try:

        def targets() -> list[dict] | None:
            try:
                active = httpx.get(api + "/targets", timeout=2).json()["data"]["activeTargets"]
            except (httpx.HTTPError, ValueError, KeyError):
                return None
            return active if len(active) >= 4 and all(t["health"] == "up" for t in active) else None

        active = wait_for(targets, timeout=60, interval=0.5, what="every target up")
        by_job = {}
        for t in active:
            by_job.setdefault(t["labels"]["job"], []).append(t)
        assert len(by_job["unbroken-engines"]) == 2 and len(by_job["unbroken-gateway"]) == 1
        assert {t["labels"]["endpoint"] for t in by_job["unbroken-engines"]} == {
            r["name"] for r in pipeline.status()["replicas"]
        }

        def build_info() -> set[str] | None:
            r = httpx.get(api + "/query", params={"query": "unbroken_build_info"}, timeout=2)
            got = {s["metric"]["component"] for s in r.json()["data"]["result"]}
            return got if {"gateway", "engine", "controller"} <= got else None

        assert wait_for(build_info, timeout=20, interval=0.5, what="build_info")
        groups = httpx.get(api + "/rules", timeout=2).json()["data"]["groups"]
        assert [r["name"] for g in groups for r in g["rules"]] == [
            "ebpf_cuda_launch_latency_us",
            "ebpf_socket_backpressure_ratio",
            "ebpf_socket_send_buffer_fill_ratio",
        ]
        assert all(r["health"] != "err" for g in groups for r in g["rules"])
    finally:
        proc.terminate()
        proc.wait(20)


def test_agent_finds_the_pipeline_through_state_dir(pipeline: Up, tmp_path: Path) -> None:
    """An agent started apart from `unbroken up` (as with `sudo unbroken agent`, whose own
    state directory is root's) labels the pipeline's processes when pointed at its state."""
    port = free_port()
    env = {**pipeline.env, "UNBROKEN_STATE_DIR": str(tmp_path / "roots-own-state")}
    argv = [sys.executable, "-m", "unbroken", "agent", "--no-ebpf", "--interval", "0.3"]
    argv += ["--listen", f"127.0.0.1:{port}", "--state-dir", str(pipeline.state)]
    a = Proc(argv, port, tmp_path / "agent.log", env=env).start()
    try:
        names = {r["name"] for r in pipeline.status()["replicas"]} | {"gateway"}

        def labelled() -> set[str]:
            text = httpx.get(a.url + "/metrics", timeout=5).text
            return set(re.findall(r'endpoint="([^"]+)"', text)) & names

        assert wait_for(lambda: labelled() >= {"gateway"}, timeout=20, what="gateway labelled")
    finally:
        a.stop()
