"""`unbroken up` end to end: real supervisor, gateway and engine processes."""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import MODEL, Up, wait_for
from unbroken.engine.textmodel import expected_chat, expected_completion
from unbroken.wire.http import free_port


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    u = Up(tmp_path_factory.mktemp("up"))
    yield u
    u.stop()


def test_openai_client_streams_and_non_streams(up: Up) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=up.url + "/v1", api_key="sk-unused")
    msgs = [{"role": "user", "content": "Write a haiku"}]
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=20, temperature=0, stream=True
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected_chat(msgs, 20).text
    assert chunks[-1].choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20, temperature=0)
    assert chat.choices[0].message.content == text and chat.usage.completion_tokens == 20
    comp = client.completions.create(
        model=MODEL, prompt="The pipeline", max_tokens=15, temperature=0
    )
    assert comp.choices[0].text == expected_completion("The pipeline", 15).text
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL, prompt="The pipeline", max_tokens=15, temperature=0, stream=True
        )
    )
    assert streamed == comp.choices[0].text
    assert [m.id for m in client.models.list()] == [MODEL]


def test_default_pipeline_and_status(up: Up) -> None:
    st = up.status()
    pools = sorted((e["pool"], e["state"]) for e in st["gateway"]["endpoints"])
    assert pools == [("fallback", "ready"), ("primary", "ready"), ("primary", "ready")]
    assert all(r["alive"] and r["start_to_health_s"] is not None for r in st["replicas"])
    human = subprocess.run(
        [sys.executable, "-m", "unbroken", "status"],
        env=up.env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert human.returncode == 0 and "primary" in human.stdout and "ready" in human.stdout
    # The gateway's line as `unbroken up` prints it (status printed `gateway http://...`).
    assert f"gateway: {up.url}/v1   admin: " in human.stdout, human.stdout
    assert f"gateway: {up.url}/v1   admin: " in up.log.read_text()
    token_file = up.state / "admin-token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert "admin token" in up.log.read_text()


def test_second_up_refuses_while_one_runs(up: Up) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "unbroken", "up", "--port", str(free_port())],
        env=up.env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 1 and "already running" in r.stderr
    # One line naming the directory and the way to run a second pipeline (docs/pipeline.md).
    assert f"with the state directory {up.state} (pid" in r.stderr, r.stderr
    assert "set UNBROKEN_STATE_DIR to another directory" in r.stderr, r.stderr


def test_supervisor_replaces_killed_replica_and_shuts_down_clean(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"""
model: {MODEL}
pools:
  - name: main
    replicas: 1
    weights_size: 8MiB
    engine: {{profile: fp16, overrides: {{decode_base_s: 0.004}}}}
  - name: custom
    replicas: 1
    engine:
      kind: command
      command: ["{sys.executable}", "-m", "unbroken", "engine", "--port", "{{port}}",
                "--served-model-name", "{{model}}", "--profile", "fp8"]
""")
    u = Up(tmp_path, spec, env={"UNBROKEN_ADMIN_TOKEN": "from-env"})
    try:
        assert (u.state / "admin-token").read_text().strip() == "from-env"
        st = u.status()
        names = {r["name"]: r for r in st["replicas"]}
        assert set(names) == {"main-1", "custom-1"}
        os.kill(names["main-1"]["pid"], signal.SIGKILL)

        def replaced() -> bool:
            s = u.status()
            eps = {e["name"]: e["state"] for e in s["gateway"]["endpoints"]}
            return eps.get("main-2") == "ready" and "main-1" not in eps

        wait_for(replaced, timeout=30, interval=0.2, what="replacement ready")
        events = [e["event"] for e in u.status()["events"]]
        assert "replica_died" in events and "replica_replaced" in events
        pids = [r["pid"] for r in u.status()["replicas"]] + [u.status()["gateway_pid"]]
    finally:
        code = u.stop()
    assert code == 0
    log = u.log.read_text()
    assert "stopping" in log and re.search(r"\nstopped in \d+\.\d s\n", log), log[-500:]
    time.sleep(0.2)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize(
    ("text", "expect"),
    [
        ("pools:\n  - name: a\n    replicas: -1\n", "pools.0.replicas"),
        ("pools: []\n", "pools"),
        ("pools:\n  - name: Bad_Name\n", "pools.0.name"),
        ("pools:\n  - name: a\n    engine: {kind: command}\n", "pools.0.engine"),
        ("pools:\n  - name: a\ngateway: {port: 99999}\n", "gateway.port"),
        ("pools:\n  - name: a\ngateway: {routes: {critical: [zzz]}}\n", "zzz"),
        ("pools: [\n", "invalid YAML"),
        ("- 1\n", "mapping"),
    ],
)
def test_spec_errors_name_the_field(tmp_path: Path, text: str, expect: str) -> None:
    spec = tmp_path / "bad.yaml"
    spec.write_text(text)
    r = subprocess.run(
        [sys.executable, "-m", "unbroken", "up", str(spec)],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "UNBROKEN_STATE_DIR": str(tmp_path / "s")},
    )
    assert r.returncode == 2 and expect in r.stderr, r.stderr
    assert "<unicode string>" not in r.stderr, r.stderr  # a YAML error names the file
    if expect == "invalid YAML":
        assert f'in "{spec}", line' in " ".join(r.stderr.split()), r.stderr


def test_supervisor_restarts_a_dead_gateway(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        f"model: {MODEL}\npools:\n  - name: main\n    replicas: 1\n    weights_size: 8MiB\n"
    )
    u = Up(tmp_path, spec)
    try:
        old = u.status()["gateway_pid"]
        os.kill(old, signal.SIGKILL)

        def back() -> bool:
            try:
                st = u.status()
            except subprocess.CalledProcessError:
                return False
            eps = (st.get("gateway") or {}).get("endpoints") or []
            return st["gateway_pid"] != old and [e["state"] for e in eps] == ["ready"]

        wait_for(back, timeout=30, interval=0.3, what="gateway restarted with its engine")
        from openai import OpenAI

        c = OpenAI(base_url=u.url + "/v1", api_key="x")
        r = c.completions.create(model=MODEL, prompt="back", max_tokens=4, temperature=0)
        assert r.choices[0].text == expected_completion("back", 4).text
        assert "gateway_restarted" in [e["event"] for e in u.status()["events"]]
    finally:
        assert u.stop() == 0


def test_companions_stop_together() -> None:
    """The agent and the controller get SIGTERM together and are waited for together: two
    companions that take 1 s each to exit stop in about 1 s, not 2, and exit by themselves
    (no SIGKILL). (The old code also signalled both first, so it passes there too: the
    reviewer's 6.5 s `down` was the agent killed at the 5 s timeout, see the commit.)"""
    import asyncio
    import textwrap

    from unbroken.config.spec import default_spec
    from unbroken.pipeline.companions import Companion, Companions

    slow = textwrap.dedent("""
        import signal, sys, time
        signal.signal(signal.SIGTERM, lambda *a: (time.sleep(1.0), sys.exit(0)))
        print("ready", flush=True)
        time.sleep(60)
    """)

    async def go() -> float:
        comps = Companions(default_spec(), Path("/nonexistent"), "http://x", "t")
        for name in ("agent", "controller"):
            c = Companion(name, [], {}, "http://x")
            c.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", slow, stdout=asyncio.subprocess.PIPE
            )
            assert c.proc.stdout is not None
            await c.proc.stdout.readline()  # its handler is set
            comps.items[name] = c
        t0 = time.monotonic()
        await comps.stop()
        assert all(c.proc is not None and c.proc.returncode == 0 for c in comps.items.values())
        return time.monotonic() - t0

    took = asyncio.run(go())
    assert 0.9 < took < 1.8, took
