"""Contention episodes and the engine's admin API: real engine processes on real sockets, the
real stand-in CUDA library, a real `unbroken up` for the `unbroken fault` command."""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import threading
import time
from pathlib import Path

import httpx
import orjson
import pytest

from helpers import MODEL, TOKEN, Proc, Up, engine, metric, wait_for
from unbroken.clients import AdminRejected, AdminUnreachable, EngineAdmin
from unbroken.engine import cuda as cuda_mod
from unbroken.engine.core import EngineCore
from unbroken.engine.faults import Faults, SlowCuda
from unbroken.engine.profiles import EngineProfile
from unbroken.wire.http import free_port

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _gaps(p: Proc, max_tokens: int, t0_box: list[float]) -> list[tuple[float, float]]:
    """Stream one completion; (time since t0, gap) per token after the first."""
    out: list[tuple[float, float]] = []
    last = None
    with httpx.stream(
        "POST",
        p.url + "/v1/completions",
        json={"model": MODEL, "prompt": "x", "max_tokens": max_tokens, "stream": True},
        timeout=120,
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                now = time.monotonic()
                if last is not None:
                    out.append((now - t0_box[0], now - last))
                last = now
    return out


def test_contention_episode_rises_in_its_window_and_recovers(tmp_path: Path) -> None:
    """Onset 1.5 s, 2.5 s long, +30 ms per contended call (a decode step makes two: the graph
    launch and the copy of sampled ids): the client-measured ITL rises only in the window."""
    p = engine(tmp_path, fast=False)  # fp16: 20 ms decode steps
    try:
        t0 = [0.0]
        result: list[list[tuple[float, float]]] = []
        th = threading.Thread(target=lambda: result.append(_gaps(p, 400, t0)))
        t0[0] = time.monotonic()
        th.start()
        wait_for(lambda: metric(p.url, "vllm:num_requests_running") == 1)
        t0[0] = time.monotonic()
        r = httpx.post(
            p.url + "/admin/faults",
            headers=AUTH,
            json={"kind": "slow_cuda", "extra_ms": 30, "onset_s": 1.5, "duration_s": 2.5},
        )
        assert r.status_code == 200, r.text
        pending = r.json()["active"]["slow_cuda"]
        assert pending["level"] == 0 and pending["starts_in_s"] > 1.0
        assert "fault" not in httpx.get(p.url + "/metrics").text
        th.join(60)
        gaps = result[0]
        before = [g for t, g in gaps if 0.2 < t < 1.3]
        during = [g for t, g in gaps if 1.9 < t < 3.7]
        after = [g for t, g in gaps if t > 4.4]
        assert len(before) > 10 and len(during) > 10 and len(after) > 10, gaps
        base = statistics.median(before)
        assert statistics.median(during) > base + 0.040, (base, statistics.median(during))
        assert statistics.median(after) < base + 0.020, (base, statistics.median(after))
        assert httpx.get(p.url + "/admin/faults", headers=AUTH).json() == {}
    finally:
        p.stop()


def test_contention_slows_the_cuda_calls_themselves(tmp_path: Path) -> None:
    """The step's time is spent inside the real stand-in library: an episode lengthens the
    launch and copy calls (extra_ms) and the synchronize wait (factor)."""
    try:
        stub = cuda_mod.load()
    except (cuda_mod.StubBuildError, OSError) as e:
        pytest.skip(f"no C compiler: {e}")
    now = [100.0]
    faults = Faults(clock=lambda: now[0])
    core = EngineCore(EngineProfile("fp16"), lambda outs: None, cuda=stub, faults=faults)

    def timed(fn: object, *args: object) -> float:
        t = time.perf_counter()
        fn(*args)  # type: ignore[operator]
        return time.perf_counter() - t

    def best(fn: object, *args: object) -> float:  # upper bounds: the least disturbed of 3
        return min(timed(fn, *args) for _ in range(3))

    step = 0.030
    base = best(core._spend, step, False)
    launch_base = best(stub.graph_launch)
    faults.apply(SlowCuda(kind="slow_cuda", extra_ms=20, factor=2.0, onset_s=1, duration_s=5))
    assert best(core._spend, step, False) < base + 0.015  # before onset
    now[0] += 1.5
    contended = best(core._spend, step, False)
    # graph launch + copy each +20 ms, the device time doubled (+30 ms)
    assert contended > base + 0.060, (base, contended)
    assert timed(stub.graph_launch) > launch_base + 0.018
    now[0] += 5
    assert best(core._spend, step, False) < base + 0.015
    assert best(stub.graph_launch) < launch_base + 0.010


def test_episode_level_onset_ramp_expiry() -> None:
    ep = SlowCuda(kind="slow_cuda", extra_ms=10, onset_s=2, ramp_s=1, duration_s=6)
    assert [ep.level(t) for t in (0, 1.99, 2.5, 3, 5, 7.5, 8, 9)] == [
        0.0,
        0.0,
        0.5,
        1.0,
        1.0,
        0.5,
        0.0,
        0.0,
    ]
    now = [0.0]
    f = Faults(clock=lambda: now[0])
    f.apply(ep)
    assert f.cuda_penalty() == (0.0, 1.0)
    now[0] = 2.5
    assert f.cuda_penalty() == pytest.approx((0.005, 1.0))
    assert f.describe()["slow_cuda"]["remaining_s"] == pytest.approx(5.5)
    now[0] = 8.0
    assert f.cuda_penalty() == (0.0, 1.0) and f.describe() == {}


def test_jitter_and_factor_scale_with_the_ramp() -> None:
    now = [0.0]
    f = Faults(clock=lambda: now[0])
    f.apply(SlowCuda(kind="slow_cuda", jitter_ms=10, factor=3, ramp_s=2, duration_s=10))
    now[0] = 1.0  # half way up the ramp
    draws = [f.cuda_penalty() for _ in range(200)]
    assert all(0 <= e <= 0.005 and fac == pytest.approx(2.0) for e, fac in draws)
    assert len({e for e, _ in draws}) > 150 and max(e for e, _ in draws) > 0.004
    now[0] = 5.0
    assert f.cuda_penalty()[1] == pytest.approx(3.0)
    f.clear()
    assert f.cuda_penalty() == (0.0, 1.0)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"kind": "slow_cuda"}, None),  # no severity
        ({"kind": "slow_cuda", "extra_ms": 5, "ramp_s": 3, "duration_s": 4}, None),
        ({"kind": "slow_cuda", "extra_ms": 5, "onset_s": -1}, "onset_s"),
        ({"kind": "slow_cuda", "factor": 0.5}, "factor"),
        ({"kind": "slow_cuda", "extra_ms": "5"}, "extra_ms"),
        ({"kind": "quake"}, None),
        ({"kind": "hang"}, "duration_s"),
    ],
)
def test_bad_fault_bodies_are_400(shared_engine: Proc, body: dict, param: str | None) -> None:
    r = httpx.post(shared_engine.url + "/admin/faults", headers=AUTH, json=body)
    if r.status_code == 200:  # leave the shared engine clean for the next test
        httpx.delete(shared_engine.url + "/admin/faults", headers=AUTH)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if param:
        assert param in (err["param"] or "") or param in err["message"]


def test_engine_admin_client(shared_engine: Proc) -> None:
    async def go() -> None:
        async with EngineAdmin(shared_engine.url, TOKEN) as eng:
            r = await eng.inject(kind="slow_cuda", factor=3, onset_s=60, duration_s=10)
            assert r["accepted"] == "slow_cuda" and r["active"]["slow_cuda"]["factor"] == 3
            assert (await eng.faults())["slow_cuda"]["starts_in_s"] > 50
            assert (await eng.state())["faults"].keys() == {"slow_cuda"}
            assert await eng.clear() == {"cleared": True}
            assert await eng.faults() == {}
            assert await eng.set_max_num_seqs(max_num_seqs=9) == {"max_num_seqs": 9}
            assert await eng.config() == {"max_num_seqs": 9}
            with pytest.raises(AdminRejected) as e:
                await eng.set_max_num_seqs(max_num_seqs=0)
            assert e.value.status == 400
            await eng.set_max_num_seqs(max_num_seqs=256)
        async with EngineAdmin(shared_engine.url, "wrong") as eng:
            with pytest.raises(AdminRejected) as e:
                await eng.faults()
            assert e.value.status == 401
        async with EngineAdmin(f"http://127.0.0.1:{free_port()}", TOKEN) as eng:
            with pytest.raises(AdminUnreachable):
                await eng.faults()
        async with EngineAdmin("localhost:1", TOKEN) as eng:  # no scheme: not a URL
            with pytest.raises(AdminUnreachable, match="expected http"):
                await eng.faults()

    asyncio.run(go())


def test_an_answer_that_is_not_json_is_an_admin_error(tmp_path: Path) -> None:
    """An admin URL that points at another service (a 200 with HTML) is an AdminError
    naming the URL, not a JSON decode traceback."""
    import http.server

    class Html(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"<html>not the admin API</html>"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Html)
    threading.Thread(target=srv.serve_forever, daemon=True).start()

    async def go() -> None:
        async with EngineAdmin(f"http://127.0.0.1:{srv.server_address[1]}", TOKEN) as eng:
            with pytest.raises(AdminRejected, match=r"not a JSON answer .*/admin/faults"):
                await eng.faults()

    try:
        asyncio.run(go())
    finally:
        srv.shutdown()


def test_huge_seed_is_400_like_vllm(shared_engine: Proc) -> None:
    for path, extra in (
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ):
        for seed in (2**63, -(2**63) - 1):
            r = httpx.post(
                shared_engine.url + path,
                json={"model": MODEL, "max_tokens": 3, "temperature": 1, "seed": seed, **extra},
            )
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "seed"
        r = httpx.post(
            shared_engine.url + path,
            json={"model": MODEL, "max_tokens": 3, "temperature": 1, "seed": 2**63 - 1, **extra},
        )
        assert r.status_code == 200, r.text


def test_a_reused_request_id_is_not_aborted_with_the_disconnected_one(
    shared_engine: Proc,
) -> None:
    """Client A streams with X-Request-Id dup and hangs up; B, non-streaming with the same id,
    must still finish (it was aborted with A and hung before ids were made unique)."""
    p = shared_engine
    payload = orjson.dumps({"model": MODEL, "prompt": "a", "max_tokens": 5000, "stream": True})
    a = socket.create_connection(("127.0.0.1", p.port))
    a.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"X-Request-Id: dup\r\nContent-Length: "
        + str(len(payload)).encode()
        + b"\r\n\r\n"
        + payload
    )
    a.recv(1024)
    out: dict = {}

    def b() -> None:
        out["r"] = httpx.post(
            p.url + "/v1/completions",
            json={"model": MODEL, "prompt": "b", "max_tokens": 200},
            headers={"X-Request-Id": "dup"},
            timeout=20,
        )

    th = threading.Thread(target=b)
    th.start()
    wait_for(lambda: metric(p.url, "vllm:num_requests_running") == 2, what="both running")
    a.close()
    th.join(25)
    r = out.get("r")
    assert r is not None and r.status_code == 200, r and r.text
    body = r.json()
    assert body["id"] == "cmpl-dup" and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 200


def test_vllm_request_metrics(tmp_path: Path) -> None:
    p = engine(tmp_path, "--max-num-seqs", "1")
    try:
        text = httpx.get(p.url + "/metrics").text
        for reason in ("stop", "length", "abort"):
            assert metric(p.url, "vllm:request_success_total", finished_reason=reason) == 0
        assert "process_resident_memory_bytes" in text and "process_cpu_seconds_total" in text
        from unbroken import __version__

        assert metric(p.url, "unbroken_build_info", version=__version__) == 1
        body = {"model": MODEL, "prompt": "one two three", "max_tokens": 60}
        ts = [
            threading.Thread(
                target=httpx.post,
                args=(p.url + "/v1/completions",),
                kwargs={"json": body, "timeout": 30},
            )
            for _ in range(2)
        ]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
        m = lambda name: metric(p.url, name)  # noqa: E731
        assert m("vllm:request_prompt_tokens_count") == 2
        assert m("vllm:request_prompt_tokens_sum") == 6
        assert m("vllm:request_generation_tokens_sum") == 120
        assert m("vllm:request_success_total") == 2
        # One slot: the second request waited for the whole of the first one's decode.
        queue, decode = (
            m("vllm:request_queue_time_seconds_sum"),
            m("vllm:request_decode_time_seconds_sum"),
        )
        assert queue > 0.3 * decode > 0, (queue, decode)
        assert m("vllm:request_inference_time_seconds_sum") >= m(
            "vllm:request_decode_time_seconds_sum"
        )
        assert m("vllm:request_prefill_time_seconds_count") == 2
        assert m("vllm:request_time_per_output_token_seconds_count") == 2
        assert m("vllm:e2e_request_latency_seconds_sum") >= m(
            "vllm:request_inference_time_seconds_sum"
        )
    finally:
        p.stop()


def _spec(tmp_path: Path) -> Path:
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        f"model: {MODEL}\npools:\n  - name: main\n    replicas: 2\n    weights_size: 8MiB\n"
    )
    return spec


def test_unbroken_fault_command_against_a_running_pipeline(tmp_path: Path) -> None:
    u = Up(tmp_path, _spec(tmp_path))
    try:
        wait_for(lambda: len(u.status()["gateway"]["endpoints"]) == 2, timeout=60, interval=0.3)
        eps = {e["name"]: e["url"] for e in u.status()["gateway"]["endpoints"]}
        # The engines' own token where the pipeline has one, else the gateway's.
        tfile = u.state / "engine-token"
        token = (tfile if tfile.exists() else u.state / "admin-token").read_text().strip()
        auth = {"Authorization": f"Bearer {token}"}

        r = u.run(
            "fault",
            "main-1",
            "slow_cuda",
            "--extra-ms",
            "12",
            "--onset",
            "30",
            "--seconds",
            "20",
            "--ramp",
            "2",
        )
        assert r.returncode == 0, r.stderr
        got = httpx.get(eps["main-1"] + "/admin/faults", headers=auth).json()
        assert got["slow_cuda"]["extra_ms"] == 12 and got["slow_cuda"]["ramp_s"] == 2
        assert httpx.get(eps["main-2"] + "/admin/faults", headers=auth).json() == {}

        r = u.run("fault", "--all", "slow_cuda", "--factor", "3", "--json")
        assert r.returncode == 0, r.stderr
        assert set(json.loads(r.stdout)) == set(eps)
        for url in eps.values():
            assert httpx.get(url + "/admin/faults", headers=auth).json()["slow_cuda"]["factor"] == 3

        r = u.run("fault", "main-2", "show")
        assert r.returncode == 0 and '"factor": 3' in r.stdout, r.stdout
        r = u.run("fault", "--all", "clear")
        assert r.returncode == 0, r.stderr
        for url in eps.values():
            assert httpx.get(url + "/admin/faults", headers=auth).json() == {}

        for args, expect in (
            (("nope-9", "hang", "--seconds", "1"), "no endpoint named 'nope-9'"),
            (("main-1", "quake"), "unknown fault kind"),
            (("main-1",), "give a fault KIND"),
            (("main-1", "hang", "--seconds", "1", "--admin-url", "localhost:1"), "--admin-url"),
            (("main-1", "hang", "--extra-ms", "5", "--seconds", "1"), "--extra-ms"),
            (("main-1", "slow_cuda"), "severity"),
            (("main-1", "slow_cuda", "--extra-ms", "-3"), "extra_ms"),
        ):
            r = u.run("fault", *args)
            assert r.returncode == 2, (args, r.returncode, r.stderr)
            assert expect in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    finally:
        assert u.stop() == 0
    r = u.run("fault", "main-1", "clear")
    assert r.returncode == 2 and "no pipeline running" in r.stderr, r.stderr
