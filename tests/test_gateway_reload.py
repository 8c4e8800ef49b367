"""Gateway reload (SIGHUP) and graceful shutdown (SIGTERM), with real engines (simulator),
real gateway processes and real clients that check every stream's text byte for byte."""

from __future__ import annotations

import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from helpers import MODEL, Proc, admin, engine, gateway, metric, wait_for
from unbroken.engine.textmodel import expected_completion
from unbroken.wire.sse import SSEDecoder

USERS = 40


def read_stream(c: httpx.Client, url: str, prompt: str, n: int) -> tuple[str, dict | None]:
    """(text, error event or None) of one streamed completion; raises on a cut stream."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True}
    dec = SSEDecoder()
    parts: list[str] = []
    error = None
    done = False
    with c.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return "", {"status": r.status_code, "body": r.read().decode()}
        for chunk in r.iter_bytes():
            for ev in dec.feed(chunk):
                if ev.data is None:
                    continue
                if ev.is_done:
                    done = True
                elif "error" in (obj := ev.json()):
                    error = obj["error"]
                else:
                    parts.append(obj["choices"][0]["text"])
    if not done:
        raise ConnectionError("stream ended without [DONE]")
    return "".join(parts), error


@pytest.fixture(scope="module")
def module_engines(logdir: Path) -> Iterator[tuple[Proc, Proc]]:
    """Two engines for the module: the tests signal and kill gateways, never these."""
    args = ("--decode-base-s", "0.01", "--max-num-seqs", "64")
    a = engine(logdir, *args, name="a")
    b = engine(logdir, *args, name="b")
    yield a, b
    a.stop()
    b.stop()


@pytest.fixture
def engines(module_engines: tuple[Proc, Proc]) -> tuple[Proc, Proc]:
    """The module's engines, idle: a test starts with nothing left running from the last
    (a gateway that goes ends its upstream streams, and the engine drops them)."""
    for e in module_engines:
        wait_for(
            lambda e=e: metric(e.url, "vllm:num_requests_running") == 0,
            timeout=30,
            what=f"{e.url} idle",
        )
    return module_engines


def test_five_reloads_under_40_streaming_users(tmp_path: Path, engines: tuple[Proc, Proc]) -> None:
    """5 SIGHUPs in a row while 40 users stream (keep-alive clients, as the openai client
    is): no refused connection, no broken or altered stream, and old workers drain away."""
    a, b = engines
    g = gateway(tmp_path, a.url, b.url, args=("--workers", "2"))
    stop = threading.Event()
    tally: Counter[str] = Counter()
    problems: list[str] = []
    lock = threading.Lock()

    def user(i: int) -> None:
        k = 0
        with httpx.Client(timeout=httpx.Timeout(60, connect=5)) as c:
            while not stop.is_set():
                prompt, n = f"user {i} request {k}", 30 + (i * 7 + k) % 40
                try:
                    text, err = read_stream(c, g.url, prompt, n)
                except httpx.ConnectError as e:
                    outcome, why = "refused", repr(e)
                except (httpx.HTTPError, ConnectionError) as e:
                    outcome, why = "broken", repr(e)
                else:
                    if err is not None:
                        outcome, why = "error", str(err)
                    elif text != expected_completion(prompt, n).text:
                        outcome, why = "altered", prompt
                    else:
                        outcome, why = "ok", ""
                with lock:
                    tally[outcome] += 1
                    if why:
                        problems.append(f"{outcome}: {why}")
                k += 1

    try:
        main_pid = g.pid
        threads = [threading.Thread(target=user, args=(i,), daemon=True) for i in range(USERS)]
        for t in threads:
            t.start()
        wait_for(lambda: tally["ok"] >= USERS, timeout=30, what="streams flowing")
        saw_draining = 0
        for n in range(1, 6):
            g.signal(signal.SIGHUP)
            ws = wait_for(
                lambda n=n: (
                    (w := admin(g, "GET", "/admin/status").json()["workers"])["generation"] == n
                    and w
                ),
                timeout=60,
                interval=0.05,
                what=f"reload {n}",
            )
            saw_draining = max(saw_draining, ws["draining"])
            time.sleep(0.3)
        before_end = tally["ok"]
        time.sleep(1.0)
        stop.set()
        for t in threads:
            t.join(60)
        print(f"5 reloads under {USERS} users: {dict(tally)}")
        assert not problems, (dict(tally), problems[:10])
        assert tally["ok"] > before_end > 5 * USERS, dict(tally)
        assert saw_draining >= 1  # old workers were finishing streams, and said so
        ws = wait_for(
            lambda: (
                (w := admin(g, "GET", "/admin/status").json()["workers"])["draining"] == 0 and w
            ),
            timeout=30,
        )
        assert ws["serving"] == 2 and ws["main_pid"] == main_pid == g.pid
        assert metric(g.url, "unbroken_gateway_worker_restarts_total", kind="reload") == 5
        assert metric(g.url, "unbroken_gateway_workers", state="draining") == 0
        assert metric(g.url, "unbroken_gateway_streams_dropped_total") == 0
    finally:
        stop.set()
        assert g.stop() == 0


def test_reload_with_broken_code_keeps_the_old_workers(
    tmp_path: Path, engines: tuple[Proc, Proc]
) -> None:
    """A reload whose new workers cannot start (here: settings on disk that no longer
    validate) leaves the serving workers alone."""
    a, _ = engines
    cfg = tmp_path / "gw.yaml"
    cfg.write_text("queue_timeout_s: 10\n")
    g = gateway(tmp_path, a.url, args=("--workers", "2", "--config", str(cfg)))
    try:
        pids = admin(g, "GET", "/admin/status").json()["workers"]["pids"]
        cfg.write_text("queue_timeout_s: -1\n")
        g.signal(signal.SIGHUP)
        wait_for(lambda: "cannot read the settings" in g.tail(), timeout=10)
        ws = admin(g, "GET", "/admin/status").json()["workers"]
        assert ws["pids"] == pids and ws["generation"] == 0
        with httpx.Client(timeout=30) as c:
            text, err = read_stream(c, g.url, "still here", 10)
        assert err is None and text == expected_completion("still here", 10).text
    finally:
        g.stop()


def _health(url: str) -> tuple[int, str]:
    r = httpx.get(url + "/health", timeout=2)
    return r.status_code, r.text


@pytest.mark.parametrize("workers", ["1", "2"])
def test_sigterm_finishes_streams_then_exits_0(
    tmp_path: Path, engines: tuple[Proc, Proc], workers: str
) -> None:
    """SIGTERM: /health says 503 at once, the listener closes (every process's copy: a new
    client is refused while the streams drain, not queued for nobody), open streams finish
    whole, exit 0."""
    a, _ = engines
    g = gateway(tmp_path, a.url, args=("--workers", workers, "--shutdown-timeout", "30"))
    n = 300  # ~3 s at 10 ms a step
    with ThreadPoolExecutor(6) as pool:
        clients = [httpx.Client(timeout=60) for _ in range(6)]
        jobs = [pool.submit(read_stream, clients[i], g.url, f"term {i}", n) for i in range(6)]
        time.sleep(0.5)
        g.signal(signal.SIGTERM)
        t_sig = time.monotonic()
        while (got := _health(g.url))[0] != 503 and time.monotonic() - t_sig < 0.4:
            time.sleep(0.01)  # the signal is handled within moments; the listener stays 0.5 s
        assert got[0] == 503 and "shutting down" in got[1], got
        time.sleep(max(0.0, t_sig + 1.0 - time.monotonic()))
        assert not any(j.done() for j in jobs)  # still draining
        with pytest.raises(httpx.ConnectError):
            httpx.get(g.url + "/health", timeout=2)
        results = [j.result() for j in jobs]
        for c in clients:
            c.close()
    for i, (text, err) in enumerate(results):
        assert err is None, err
        assert text == expected_completion(f"term {i}", n).text
    assert g.popen is not None
    assert g.popen.wait(30) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(g.url + "/health", timeout=2)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_second_sigterm_ends_streams_with_an_error_event(
    tmp_path: Path, engines: tuple[Proc, Proc], workers: str
) -> None:
    a, _ = engines
    g = gateway(tmp_path, a.url, args=("--workers", workers, "--shutdown-timeout", "60"))
    with ThreadPoolExecutor(3) as pool:
        jobs = [
            pool.submit(read_stream, httpx.Client(timeout=60), g.url, f"long {i}", 3000)
            for i in range(3)
        ]
        time.sleep(1.0)
        g.signal(signal.SIGTERM)
        time.sleep(1.0)
        t0 = time.monotonic()
        g.signal(signal.SIGTERM)
        results = [j.result() for j in jobs]  # [DONE] after the error event, never a cut
        took = time.monotonic() - t0
    assert took < 10
    for i, (text, err) in enumerate(results):
        assert err is not None and err["code"] == "shutdown", err
        assert text and expected_completion(f"long {i}", 3000).text.startswith(text)
    assert g.popen is not None and g.popen.wait(30) == 0


def test_shutdown_timeout_ends_what_is_left(tmp_path: Path, engines: tuple[Proc, Proc]) -> None:
    a, _ = engines
    g = gateway(tmp_path, a.url, args=("--workers", "2", "--shutdown-timeout", "1"))
    with httpx.Client(timeout=60) as c, ThreadPoolExecutor(1) as pool:
        job = pool.submit(read_stream, c, g.url, "too long", 3000)
        time.sleep(1.0)
        t0 = time.monotonic()
        g.signal(signal.SIGTERM)
        text, err = job.result()
        took = time.monotonic() - t0
    assert err is not None and err["code"] == "shutdown"
    assert expected_completion("too long", 3000).text.startswith(text)
    assert 1.0 <= took < 8, took
    assert g.popen is not None and g.popen.wait(30) == 0


def test_unbroken_reload_under_unbroken_up(tmp_path: Path) -> None:
    """`unbroken reload` reloads the pipeline's gateway through SIGHUP: streams running
    across it complete byte-exact, the gateway's pid stays, and the supervisor records no
    gateway death or restart."""
    from helpers import Up

    up = Up(tmp_path)
    try:
        st = up.status()
        pid = st["gateway_pid"]
        wait_for(
            lambda: sum(e["state"] == "ready" for e in up.status()["gateway"]["endpoints"]) >= 2,
            timeout=60,
        )
        with ThreadPoolExecutor(6) as pool:
            jobs = [
                pool.submit(read_stream, httpx.Client(timeout=60), up.url, f"up {i}", 120)
                for i in range(6)
            ]
            time.sleep(0.3)
            r = up.run("reload")
            assert r.returncode == 0, r.stderr
            assert f"pid {pid}" in r.stdout
            results = [j.result() for j in jobs]
        for i, (text, err) in enumerate(results):
            assert err is None and text == expected_completion(f"up {i}", 120).text
        gw_admin = f"http://127.0.0.1:{up.admin_port}"
        token = (up.state / "admin-token").read_text().strip()
        ws = wait_for(
            lambda: (
                (
                    w := httpx.get(
                        gw_admin + "/admin/status", headers={"Authorization": f"Bearer {token}"}
                    ).json()["workers"]
                )["generation"]
                == 1
                and w["draining"] == 0
                and w
            ),
            timeout=60,
        )
        assert ws["main_pid"] == pid
        st = up.status()
        assert st["gateway_pid"] == pid
        assert "exited unexpectedly" not in up.log.read_text()  # no crash seen, no restart
        with httpx.Client(timeout=30) as c:
            text, err = read_stream(c, up.url, "after reload", 10)
        assert err is None and text == expected_completion("after reload", 10).text
    finally:
        assert up.stop() == 0


def test_workers_exit_when_the_main_process_is_killed(
    tmp_path: Path, engines: tuple[Proc, Proc]
) -> None:
    """SIGKILL of the main process: its workers (told by the kernel) finish what they hold
    within --shutdown-timeout and exit, so no orphan keeps the port."""
    import os

    a, _ = engines
    g = gateway(tmp_path, a.url, args=("--workers", "2", "--shutdown-timeout", "2"))
    pids = admin(g, "GET", "/admin/status").json()["workers"]["pids"]
    g.signal(signal.SIGKILL)

    def gone(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        # A zombie is gone too (its parent, the killed main process, cannot reap it).
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"

    wait_for(lambda: all(gone(p) for p in pids), timeout=15, what="workers gone")
    with pytest.raises(httpx.ConnectError):
        httpx.get(g.url + "/health", timeout=2)
