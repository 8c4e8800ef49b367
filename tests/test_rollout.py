"""Rolling upgrades and drains against a running `unbroken up`."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers import MODEL, Poller, Up, wait_for
from test_migration import check_one_stream, read_stream, text_of
from unbroken.engine.textmodel import expected_completion
from unbroken.pipeline.niceness import autogroups_enabled

SPEC = f"""
model: {MODEL}
pools:
  - name: primary
    replicas: 2
    weights_size: 8MiB
    engine:
      profile: fp16
      startup_idle_s: 0
      overrides: {{decode_base_s: 0.004, decode_per_seq_s: 0.00005}}
  - name: fallback
    replicas: 1
    weights_size: 8MiB
    engine: {{profile: fp8, overrides: {{decode_base_s: 0.004}}}}
gateway: {{routes: {{standard: [primary]}}}}
"""


class NiceWatch(Poller):
    """Samples every 10 ms the niceness of the supervisor's children that are engines or
    pre-warms (/proc/PID/task/*/children, then each child's cmdline and the nice field of
    its stat: a scan of all of /proc this often took most of a core)."""

    def __init__(self, parent: int) -> None:
        super().__init__()
        self.parent = parent
        self.seen: dict[tuple[str, int], set[int]] = {}  # (kind, pid) -> nice values
        self.autogroup: dict[tuple[str, int], set[int]] = {}  # its autogroup's nice values
        self.cpu_cgroup: dict[tuple[str, int], set[str]] = {}  # its cpu cgroups' names
        self.cpu_idle: dict[tuple[str, int], set[int]] = {}  # their cpu.idle, when startup's

    def _children(self) -> set[int]:
        out: set[int] = set()
        for t in Path(f"/proc/{self.parent}/task").iterdir():
            try:
                out.update(int(p) for p in (t / "children").read_text().split())
            except OSError:
                continue
        return out

    def poll(self) -> None:
        for pid in self._children():
            d = Path(f"/proc/{pid}")
            try:
                f = (d / "stat").read_text().rsplit(")", 1)[1].split()
                argv = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"unbroken" not in argv:
                continue
            kind = argv[argv.index(b"unbroken") + 1].decode()
            if kind in ("engine", "prewarm"):
                self.seen.setdefault((kind, pid), set()).add(int(f[16]))
                # "/autogroup-123 nice 10": its session's, as the scheduler sees it
                with contextlib.suppress(OSError, IndexError, ValueError):
                    ag = int((d / "autogroup").read_text().split()[2])
                    self.autogroup.setdefault((kind, pid), set()).add(ag)
                with contextlib.suppress(OSError):
                    for line in (d / "cgroup").read_text().splitlines():
                        _, ctrls, path = line.split(":", 2)
                        if "cpu" in ctrls.split(","):
                            name = path.rsplit("/", 1)[-1]
                            self.cpu_cgroup.setdefault((kind, pid), set()).add(name)
                            if name.startswith("unbroken-start-"):
                                idle = Path(f"/sys/fs/cgroup/cpu{path}/cpu.idle").read_text()
                                self.cpu_idle.setdefault((kind, pid), set()).add(int(idle))

    def values(
        self, kind: str, pids: set[int] | None = None, *, autogroup: bool = False
    ) -> set[int]:
        """Nice values seen for `kind` (of `pids`): the processes', or their autogroups'."""
        return {
            n
            for (k, pid), ns in (self.autogroup if autogroup else self.seen).items()
            if k == kind and (pids is None or pid in pids)
            for n in ns
        }


def _gateway_session(supervisor: int) -> dict[int, int]:
    """pid -> nice of every process in the session of the supervisor's `unbroken gateway`
    child (it leads its own session; its workers are in it)."""
    leader = None
    for t in Path(f"/proc/{supervisor}/task").iterdir():
        for pid in (t / "children").read_text().split():
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"unbroken" in argv and argv[argv.index(b"unbroken") + 1] == b"gateway":
                leader = int(pid)
    assert leader is not None, "no gateway process under the supervisor"
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            f = (d / "stat").read_text().rsplit(")", 1)[1].split()
            if int(f[3]) == leader:  # its session
                out[int(d.name)] = int(f[16])
    return out


def _up(tmp: Path) -> Up:
    spec = tmp / "spec.yaml"
    spec.write_text(SPEC)
    return Up(tmp, spec)


def test_rollout_migrates_long_streams_at_the_deadline(tmp_path: Path) -> None:
    u = _up(tmp_path)
    try:
        before = {r["name"]: r["pid"] for r in u.status()["replicas"]}
        results: list[tuple[list[Any], httpx.Response]] = []
        prompts = [f"a long answer {i}" for i in range(4)]
        ts = [
            threading.Thread(
                target=lambda p=p: results.append(
                    read_stream(
                        u.url,
                        "/v1/completions",
                        {"model": MODEL, "prompt": p, "max_tokens": 2000, "temperature": 0},
                    )
                )
            )
            for p in prompts
        ]
        for t in ts:
            t.start()
        time.sleep(1.0)
        t0 = time.monotonic()
        with NiceWatch(u.proc.pid) as nice:
            r = u.run(
                "rollout", "primary", "--set", "decode_base_s=0.005", "--deadline", "1", "--json"
            )
        took = time.monotonic() - t0
        assert r.returncode == 0, r.stderr
        events = [json.loads(line) for line in r.stdout.splitlines()]
        summary = events[-1]
        assert summary["event"] == "summary" and summary["ok"]
        assert [s["old"] for s in summary["steps"]] == ["primary-1", "primary-2"]
        # Two replicas, each: start (~1 s), deadline (1 s), stop: bounded, not 2,000 tokens.
        assert took < 2 * (1.0 + 5.0), took
        for t in ts:
            t.join(90)
        assert len(results) == 4
        texts = set()
        for evs, _ in results:
            check_one_stream(evs, chat=False)
            texts.add(text_of(evs, chat=False))
        assert texts == {expected_completion(p, 2000).text for p in prompts}
        st = u.status()
        names = sorted(r["name"] for r in st["replicas"])
        assert names == ["fallback-1", "primary-3", "primary-4"]
        assert all(
            before.get(r["name"]) != r["pid"]
            for r in st["replicas"]
            if r["name"].startswith("primary")
        )
        kinds = [e["event"] for e in st["events"]]
        assert kinds.count("rollout_replaced") == 2
        # The surge replicas started niced and serve at nice 0; the pre-warm ran niced.
        new = {r["pid"] for r in st["replicas"] if r["name"] in ("primary-3", "primary-4")}
        for pid in new:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            assert int(fields[16]) == 0, pid
        if os.geteuid() == 0:  # CI: the supervisor can raise them back, so it lowers them
            assert nice.values("engine", new) == {10, 0}, nice.seen
            assert nice.values("prewarm") >= {10}, nice.seen
            if autogroups_enabled():
                # Sessions are scheduled as units here: the session's own nice is what
                # lowers a starting engine against the serving ones (pipeline/niceness.py).
                assert nice.values("engine", new, autogroup=True) == {10, 0}, nice.autogroup
                assert 10 in nice.values("prewarm", autogroup=True), nice.autogroup
            # The gateway's session runs above the engines (gateway.nice, default -5), its
            # workers included (pipeline/gateway_proc.py).
            gw = _gateway_session(u.proc.pid)
            assert len(gw) >= 3, gw  # the main process and its workers (at least 2)
            assert set(gw.values()) == {-5}, gw
            if autogroups_enabled():
                main = min(gw)
                assert Path(f"/proc/{main}/autogroup").read_text().split()[2] == "-5"
            if Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").exists():
                # Started beside serving replicas: under the startup CPU quota in a cgroup
                # of their own until they served, then back where the supervisor is
                # (pipeline/cpucap.py).
                own = Path(f"/proc/{u.proc.pid}/cgroup").read_text()
                home = next(
                    ln.split(":", 2)[2].rsplit("/", 1)[-1]
                    for ln in own.splitlines()
                    if "cpu" in ln.split(":", 2)[1].split(",")
                )
                for pid in new:
                    names = nice.cpu_cgroup.get(("engine", pid), set())
                    assert any(n.startswith("unbroken-start-") for n in names), names
                    # startup_idle_s is 0 in SPEC: a busy suite's idle-only start took this test
                    # past its bound; test_a_start_longer_than_startup_idle_s... covers it
                    assert nice.cpu_idle.get(("engine", pid)) == {0}, nice.cpu_idle
                    now = Path(f"/proc/{pid}/cgroup").read_text()
                    assert "unbroken-start-" not in now, now
                    assert home in names, (home, names)
                assert not list(Path("/sys/fs/cgroup/cpu").glob(f"unbroken-start-{u.proc.pid}-*"))
        else:  # it could not undo a lowered priority, so it never lowers one
            assert nice.values("engine", new) == {0}, nice.seen
    finally:
        assert u.stop() == 0


def test_a_start_longer_than_startup_idle_s_gets_its_quota_share(tmp_path: Path) -> None:
    """A starting replica runs SCHED_IDLE (cpu.idle) only for `startup_idle_s`: on a busy
    node an idle group would hardly start. With 0.2 s, the surge replica's cgroup is seen
    idle, then normal, before the replica serves (its imports alone take longer)."""
    if os.geteuid() != 0 or not Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").exists():
        pytest.skip("the startup cgroup needs root and cgroup v1's cpu controller (CI has both)")
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        SPEC.replace(
            "startup_idle_s: 0\n",
            "startup_idle_s: 0.2\n",
        )
    )
    u = Up(tmp_path, spec)
    try:
        with NiceWatch(u.proc.pid) as nice:
            r = u.run("rollout", "primary", "--deadline", "1", "--json")
        assert r.returncode == 0, r.stderr
        new = {x["pid"] for x in u.status()["replicas"] if x["name"] in ("primary-3", "primary-4")}
        seen = {k: v for k, v in nice.cpu_idle.items() if k[1] in new}
        assert seen and all(v == {1, 0} for v in seen.values()), nice.cpu_idle
    finally:
        assert u.stop() == 0


def test_rollback_when_the_new_replica_fails_stage_2(tmp_path: Path) -> None:
    u = _up(tmp_path)
    try:
        before = sorted((r["name"], r["pid"]) for r in u.status()["replicas"])
        # A 5 s decode step cannot answer the warm-up within a 1 s budget.
        r = u.run("rollout", "primary", "--set", "decode_base_s=5", "--warmup-budget", "1")
        assert r.returncode == 1
        assert "rolled back" in r.stderr and "warm-up" in r.stderr
        st = u.status()
        assert sorted((r["name"], r["pid"]) for r in st["replicas"]) == before
        eps = {e["name"]: e["state"] for e in st["gateway"]["endpoints"]}
        assert eps == {"primary-1": "ready", "primary-2": "ready", "fallback-1": "ready"}
        res = httpx.post(
            u.url + "/v1/completions",
            json={"model": MODEL, "prompt": "still here", "max_tokens": 5, "temperature": 0},
            timeout=30,
        )
        assert res.json()["choices"][0]["text"] == expected_completion("still here", 5).text
        bad = u.run("rollout", "nosuchpool")
        assert bad.returncode == 1 and "no pool named" in bad.stderr
    finally:
        u.stop()


def test_drain_cli_waits_until_empty(tmp_path: Path) -> None:
    u = _up(tmp_path)
    try:
        out: dict[str, Any] = {}
        t = threading.Thread(
            target=lambda: out.update(
                r=read_stream(
                    u.url,
                    "/v1/completions",
                    {"model": MODEL, "prompt": "keep going", "max_tokens": 600, "temperature": 0},
                )
            )
        )
        t.start()
        # On CI's busy cores the stream had not reached an engine after a fixed 0.5 s.
        serving = wait_for(
            lambda: next(
                (e["name"] for e in u.status()["gateway"]["endpoints"] if e["inflight"]), None
            ),
            timeout=15,
            what="the stream under way on an endpoint",
        )
        pid = next(x["pid"] for x in u.status()["replicas"] if x["name"] == serving)
        t0 = time.monotonic()
        r = u.run("drain", serving, "--deadline", "60")
        assert r.returncode == 0, r.stderr
        assert "drained" in r.stderr
        t.join(30)
        events, _ = out["r"]
        assert text_of(events, chat=False) == expected_completion("keep going", 600).text
        assert time.monotonic() - t0 > 0.3  # it waited for the stream, not the deadline
        # Under `unbroken up` the pool keeps its size: the drained replica's engine is
        # stopped (it kept running outside the gateway, "unregistered", and the pool stayed
        # one short with no way back) and a successor serves in its place.
        st = u.status()
        eps = {e["name"]: e for e in st["gateway"]["endpoints"]}
        assert serving not in eps and serving not in {x["name"] for x in st["replicas"]}
        pool = serving.rsplit("-", 1)[0]
        mine = [n for n, e in eps.items() if e["pool"] == pool]
        assert len(mine) == 2 and all(eps[n]["state"] == "ready" for n in mine), eps
        assert st["pools"][pool] == {"declared": 2, "live": 2}, st["pools"]
        successor = next(iter(set(mine) - {"primary-1", "primary-2"}))
        assert f"{successor} serves in its place" in r.stderr, r.stderr
        wait_for(lambda: not os.path.exists(f"/proc/{pid}"), timeout=10, what="engine gone")
        assert "unregistered" not in u.run("status").stdout
        # Drained through the gateway's admin API alone, a replica runs unregistered;
        # `unbroken drain` of it stops it and brings up a successor as well.
        token = (u.state / "admin-token").read_text().strip()
        httpx.post(
            f"http://127.0.0.1:{u.admin_port}/admin/endpoints/{successor}/drain",
            json={"deadline_s": 1},
            headers={"Authorization": f"Bearer {token}"},
            timeout=10,
        ).raise_for_status()
        wait_for(
            lambda: successor not in {e["name"] for e in u.status()["gateway"]["endpoints"]},
            timeout=10,
            what="the admin API's drain",
        )
        assert f"{successor}" in u.run("status").stdout  # unregistered, still running
        r = u.run("drain", successor)
        assert r.returncode == 0 and "the gateway no longer listed it" in r.stderr, r.stderr
        eps = {e["name"]: e for e in u.status()["gateway"]["endpoints"]}
        assert len([n for n, e in eps.items() if e["pool"] == pool]) == 2, eps
        r = u.run("drain", "no-such-endpoint")
        assert r.returncode == 1 and "no endpoint named" in r.stderr
    finally:
        u.stop()


def test_engine_health_timeout_is_the_pools_and_the_wait_is_logged(tmp_path: Path) -> None:
    """`engine.health_timeout_s` is how long a starting replica may take to answer /health
    (it was 120 s, fixed, for `up`, rollouts and replacements: a large vLLM model failed
    them); the wait says every 10 s that it still waits (it was silent without a terminal);
    a rollout's `--health-timeout` bounds its surge."""
    import sys

    engine = (
        f"sleep 11; exec {sys.executable} -m unbroken engine --host {{host}} --port {{port}} "
        "--served-model-name {model}"
    )
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        f"model: {MODEL}\n"
        "pools:\n"
        "  - name: slow\n"
        "    engine:\n"
        "      kind: command\n"
        f"      command: [sh, -c, {json.dumps(engine)}]\n"
        "      health_timeout_s: 60\n"
        "controller: {enabled: false}\n"
    )
    u = Up(tmp_path, spec)
    try:
        log = u.log.read_text()
        assert "waiting for slow-1 to answer /health: 10 s of 60 (pid " in log, log
        t0 = time.monotonic()
        r = u.run("rollout", "slow", "--health-timeout", "3", "--deadline", "1")
        assert r.returncode == 1 and "no /health within 3 s" in r.stderr, r.stderr
        assert time.monotonic() - t0 < 10
        st = u.status()
        assert [x["name"] for x in st["replicas"]] == ["slow-1"], st["replicas"]
    finally:
        u.stop()


def test_health_timeout_fails_up_with_its_value(tmp_path: Path) -> None:
    import subprocess
    import sys

    spec = tmp_path / "spec.yaml"
    spec.write_text(
        f"model: {MODEL}\n"
        "pools:\n"
        "  - name: stuck\n"
        "    engine: {kind: command, command: [sleep, '30'], health_timeout_s: 1.5}\n"
        "controller: {enabled: false}\n"
    )
    env = {**os.environ, "UNBROKEN_STATE_DIR": str(tmp_path / "state")}
    from unbroken.wire.http import free_port

    r = subprocess.run(
        [sys.executable, "-m", "unbroken", "up", "--no-agent", "--port", str(free_port()),
         "--admin-port", str(free_port()), str(spec)],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 1, r.stderr
    assert "stuck-1 did not answer /health within 1.5 s" in r.stderr, r.stderr


def test_an_invalid_engine_update_is_one_line_naming_the_field() -> None:
    """`unbroken rollout primary --set bogus=1` printed pydantic's multi-line error with its
    errors.pydantic.dev URL; now one line, as spec errors are."""
    from unbroken.config.spec import EngineSpec
    from unbroken.pipeline.rollout import RolloutError, new_engine

    with pytest.raises(RolloutError) as e:
        new_engine(EngineSpec(), {"overrides": {"bogus": 1.0}, "seed": "x"})
    msg = str(e.value)
    assert "\n" not in msg and "pydantic.dev" not in msg, msg
    assert "overrides.bogus: Extra inputs are not permitted" in msg, msg
    assert msg.startswith("invalid engine update: "), msg
