"""Reload with handover: old workers hand their open streams, with the client connections
(SCM_RIGHTS), to the new workers, which continue them by continuation, so an old worker exits
in seconds instead of living until its longest stream ends. Real engines (simulator), real
gateway processes, real clients (httpx, and raw sockets to see every byte on the wire)."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from helpers import MODEL, Proc, admin, engine, gateway, metric, wait_for
from unbroken.engine.textmodel import count_tokens, expected_chat, expected_completion
from unbroken.wire.sse import SSEDecoder

USERS = 40


def workers_of(g: Proc) -> dict[str, Any]:
    return admin(g, "GET", "/admin/status").json()["workers"]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def reload_and_time(g: Proc, n: int, timeout: float = 60) -> tuple[float, list[int]]:
    """SIGHUP; wait for generation `n` to serve, then for every old worker to exit. Returns
    how long the old workers lived after the new generation took over, and their pids."""
    old = workers_of(g)["pids"]
    g.signal(signal.SIGHUP)
    wait_for(lambda: workers_of(g)["generation"] == n, timeout=30, interval=0.02, what="reload")
    t_new = time.monotonic()
    wait_for(lambda: all(gone(p) for p in old), timeout=timeout, interval=0.02, what="old exit")
    return time.monotonic() - t_new, old


def read_stream(
    c: httpx.Client, url: str, prompt: str, n: int, flowing: Any = None, *, chat: bool = False
) -> tuple[str, dict[str, Any]]:
    """(text, usage) of one streamed completion or chat, asking for usage; raises on a cut
    stream, an error event, a second id, created, finish, role chunk or [DONE]."""
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": n,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    path = "/v1/chat/completions" if chat else "/v1/completions"
    dec = SSEDecoder()
    parts: list[str] = []
    seen: set[tuple[str, int]] = set()
    finishes = roles = dones = 0
    usage: dict[str, Any] = {}
    with c.stream("POST", url + path, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode()}")
        for chunk in r.iter_bytes():
            for ev in dec.feed(chunk):
                if ev.data is None:
                    continue
                if ev.is_done:
                    dones += 1
                    continue
                assert not dones, "an event after [DONE]"
                obj = ev.json()
                if "error" in obj:
                    raise RuntimeError(f"error event: {obj['error']}")
                seen.add((obj["id"], obj["created"]))
                usage = obj.get("usage") or usage
                for ch in obj["choices"]:
                    if chat:
                        roles += "role" in ch["delta"]
                        parts.append(ch["delta"].get("content") or "")
                    else:
                        parts.append(ch["text"])
                    finishes += bool(ch.get("finish_reason"))
                if flowing is not None:
                    flowing()
    if dones != 1:
        raise ConnectionError(f"stream ended with {dones} [DONE]")
    assert len(seen) == 1 and finishes == 1 and roles == (1 if chat else 0), (seen, finishes, roles)
    return "".join(parts), usage


@pytest.fixture(scope="module")
def module_engines(logdir: Path) -> Iterator[tuple[Proc, Proc]]:
    """Two engines for the module: the tests reload and stop gateways, never these."""
    args = ("--max-num-seqs", "64")
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
        wait_for(lambda e=e: _running(e) == 0, timeout=30, what=f"{e.url} idle")
    return module_engines


def test_five_reloads_hand_streams_over_under_40_users(
    tmp_path: Path, engines: tuple[Proc, Proc]
) -> None:
    """40 keep-alive users streaming long generations (each far longer than a reload), 5
    SIGHUPs in a row: no refused connection, every stream byte-exact with one id and one
    [DONE], the old workers gone within seconds of each reload (not after the longest
    stream), and the streams handed over counted."""
    a, b = engines
    g = gateway(tmp_path, a.url, b.url, args=("--workers", "2"))
    stop = threading.Event()
    tally: Counter[str] = Counter()
    problems: list[str] = []
    started: set[int] = set()
    lock = threading.Lock()

    def user(i: int) -> None:
        k = 0
        with httpx.Client(timeout=httpx.Timeout(120, connect=5)) as c:
            while not stop.is_set():
                prompt, n = f"user {i} request {k}", 1500 + (i * 37 + k * 11) % 500
                chat = i % 4 == 0
                try:
                    text, usage = read_stream(
                        c, g.url, prompt, n, lambda: started.add(i), chat=chat
                    )
                except httpx.ConnectError as e:
                    outcome, why = "refused", repr(e)
                except (httpx.HTTPError, ConnectionError, RuntimeError, AssertionError) as e:
                    outcome, why = "broken", f"{prompt}: {e!r}"
                else:
                    want = (
                        expected_chat([("user", prompt)], n)
                        if chat
                        else expected_completion(prompt, n)
                    ).text
                    # The client's usage: its own prompt, every token of every leg.
                    pt = usage.get("prompt_tokens", 0)
                    ok = (
                        usage.get("completion_tokens") == n
                        and usage.get("total_tokens") == pt + n
                        and ((0 < pt < 40) if chat else pt == count_tokens(prompt))
                    )
                    if text != want:
                        outcome, why = "altered", prompt
                    elif not ok:
                        outcome, why = "usage", f"{prompt}: {usage}"
                    else:
                        outcome, why = "ok", ""
                with lock:
                    tally[outcome] += 1
                    if why:
                        problems.append(f"{outcome}: {why}")
                k += 1

    threads = [threading.Thread(target=user, args=(i,), daemon=True) for i in range(USERS)]
    try:
        main_pid = g.pid
        for t in threads:
            t.start()
        wait_for(lambda: len(started) == USERS, timeout=60, what="every user streaming")
        lived = []
        for n in range(1, 6):
            took, _ = reload_and_time(g, n)
            lived.append(round(took, 2))
            time.sleep(0.3)
        handed_in = metric(g.url, "unbroken_gateway_streams_handed_over_total", direction="in")
        handed_out = metric(g.url, "unbroken_gateway_streams_handed_over_total", direction="out")
        stop.set()
        for t in threads:
            t.join(120)
        print(f"handover: old workers lived {lived} s after each reload; {handed_in:.0f} in")
        print(f"5 reloads under {USERS} users: {dict(tally)}")
        assert not problems, (dict(tally), problems[:10])
        assert tally["ok"] >= USERS, dict(tally)
        # Every generation took over ~40 streams, each far from its end.
        assert handed_in == handed_out >= 5 * USERS * 0.8, (handed_in, handed_out)
        assert max(lived) < 6.0, lived  # a generation lasts 8-20 s here
        ws = workers_of(g)
        assert ws["serving"] == 2 and ws["draining"] == 0 and ws["main_pid"] == main_pid
        assert metric(g.url, "unbroken_gateway_worker_restarts_total", kind="reload") == 5
        assert metric(g.url, "unbroken_gateway_streams_dropped_total") == 0
    finally:
        stop.set()
        assert g.stop() == 0


def test_handover_off_old_workers_wait_for_their_streams(
    tmp_path: Path, engines: tuple[Proc, Proc]
) -> None:
    """`handover_on_reload: false`: the old behaviour, an old worker lives until its last
    stream ends (the number the handover removes)."""
    a, _ = engines
    cfg = tmp_path / "gw.yaml"
    cfg.write_text("handover_on_reload: false\n")
    g = gateway(tmp_path, a.url, args=("--workers", "2", "--config", str(cfg)))
    try:
        with httpx.Client(timeout=120) as c:
            result: list[Any] = []
            flowing = threading.Event()
            job = threading.Thread(
                target=lambda: result.append(read_stream(c, g.url, "off", 1500, flowing.set)[0])
            )
            job.start()
            assert flowing.wait(30)
            t0 = time.monotonic()
            took, _ = reload_and_time(g, 1)
            job.join(120)
            left = time.monotonic() - t0
        print(f"no handover: the old worker lived {took:.2f} s after the reload")
        assert result == [expected_completion("off", 1500).text]
        # It lived about as long as the stream (the client, a thread on a busy box, may read
        # the last bytes from its socket buffer a while after the worker has gone).
        assert took > 3.0 and took > left / 2, (took, left)
        assert metric(g.url, "unbroken_gateway_streams_handed_over_total") == 0
    finally:
        g.stop()


def _request(body: dict[str, Any], keep_alive: bool = True) -> bytes:
    data = orjson.dumps(body)
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        b"User-Agent: raw-test\r\nX-Custom: kept\r\n"
        + (b"" if keep_alive else b"Connection: close\r\n")
        + b"Content-Length: %d\r\n\r\n" % len(data)
        + data
    )


class Wire:
    """One raw client connection, read strictly: HTTP/1.1 head, then chunked framing."""

    def __init__(self, port: int) -> None:
        self.s = socket.create_connection(("127.0.0.1", port), timeout=60)
        self.buf = b""

    def _fill(self) -> None:
        got = self.s.recv(65536)
        if not got:
            raise ConnectionError(f"closed by the gateway; unread: {self.buf[:200]!r}")
        self.buf += got

    def line(self) -> bytes:
        while b"\r\n" not in self.buf:
            self._fill()
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def head(self) -> tuple[int, dict[str, str]]:
        status = int(self.line().split()[1])
        headers = {}
        while line := self.line():
            k, v = line.decode().split(":", 1)
            headers[k.strip().lower()] = v.strip()
        return status, headers

    def chunks(self) -> Iterator[bytes]:
        """Each chunk's data; ends after the last chunk (size 0) and its CRLF."""
        while True:
            size = int(self.line().split(b";")[0], 16)
            data = self.exactly(size)
            assert self.exactly(2) == b"\r\n", "chunk not followed by CRLF"
            if size == 0:
                assert data == b""
                return
            yield data

    def idle(self, seconds: float) -> bool:
        """Nothing more arrives, and the connection stays open."""
        if self.buf:
            return False
        self.s.settimeout(seconds)
        try:
            self.buf += self.s.recv(1) or b"<closed>"
        except TimeoutError:
            return True
        finally:
            self.s.settimeout(60)
        return False


def test_handover_on_the_wire(tmp_path: Path, engines: tuple[Proc, Proc]) -> None:
    """Raw bytes across a handover: one response head, well-formed chunks only, the text
    byte-exact, one [DONE], one last chunk and nothing after it (aiohttp in the old worker
    wrote no terminator of its own); the old worker is gone while the stream still runs; and
    the same keep-alive connection then serves the next request (in the new worker)."""
    a, b = engines
    g = gateway(tmp_path, a.url, b.url, args=("--workers", "2"))
    try:
        w = Wire(g.port)
        prompt, n = "on the wire", 1200
        body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0}
        w.s.sendall(_request({**body, "stream": True}))
        status, headers = w.head()
        assert status == 200 and headers["transfer-encoding"] == "chunked", headers
        assert "connection" not in headers or headers["connection"] != "close"
        dec = SSEDecoder()
        texts: list[str] = []
        ids: set[str] = set()
        dones = 0
        reloaded: dict[str, Any] = {}

        def reload() -> None:
            reloaded["lived"], reloaded["old"] = reload_and_time(g, 1)
            reloaded["at"] = len(texts)

        r = threading.Thread(target=reload)
        gap, last = 0.0, time.monotonic()
        for data in w.chunks():
            now = time.monotonic()
            gap, last = max(gap, now - last), now
            for ev in dec.feed(data):
                assert ev.data is not None
                if ev.is_done:
                    dones += 1
                    continue
                obj = ev.json()
                assert "error" not in obj, obj
                ids.add(obj["id"])
                texts.append(obj["choices"][0]["text"])
            if len(texts) == 50:
                r.start()
        r.join(30)
        assert dones == 1 and len(ids) == 1, (dones, ids)
        assert "".join(texts) == expected_completion(prompt, n).text
        assert reloaded["at"] < n - 100, reloaded  # the old worker left mid-stream
        assert reloaded["lived"] < 5.0, reloaded
        print(f"handover on the wire: longest gap between chunks {gap * 1000:.0f} ms")
        assert gap < 3.0  # about one continuation's time to first token
        assert w.idle(0.5), w.buf  # nothing after the last chunk, no close
        assert metric(g.url, "unbroken_gateway_streams_handed_over_total", direction="in") == 1
        # The connection lives on in the new worker: the next request on it is served.
        w.s.sendall(_request({**body, "max_tokens": 12}, keep_alive=False))
        status, headers = w.head()
        assert status == 200, (status, headers)
        got = orjson.loads(w.exactly(int(headers["content-length"])))
        assert got["choices"][0]["text"] == expected_completion(prompt, 12).text
        w.s.close()
    finally:
        g.stop()


def _running(e: Proc) -> float:
    for line in httpx.get(e.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError("vllm:num_requests_running")


def test_client_leaving_after_handover_frees_the_engine(
    tmp_path: Path, engines: tuple[Proc, Proc]
) -> None:
    """A client that goes away right after its stream was handed over: the new worker sees
    it, cancels the continuation, and the engine frees the request (and the gateway its
    slot)."""
    a, _ = engines
    g = gateway(tmp_path, a.url, args=("--workers", "2"))
    try:
        w = Wire(g.port)
        body = {"model": MODEL, "prompt": "leaving", "max_tokens": 5000, "temperature": 0}
        w.s.sendall(_request({**body, "stream": True}))
        assert w.head()[0] == 200
        chunks = w.chunks()
        for _ in range(20):
            next(chunks)
        g.signal(signal.SIGHUP)
        wait_for(
            lambda: (
                metric(g.url, "unbroken_gateway_streams_handed_over_total", direction="in") == 1
            ),
            timeout=30,
            what="handed over",
        )
        for _ in range(5):  # the continuation flows from the new worker
            next(chunks)
        w.s.close()
        t0 = time.monotonic()
        wait_for(lambda: _running(a) == 0, timeout=5, what="engine request freed")
        freed = time.monotonic() - t0
        eps = admin(g, "GET", "/admin/endpoints").json()["endpoints"]
        wait_for(
            lambda: all(
                e["inflight"] == 0 for e in admin(g, "GET", "/admin/endpoints").json()["endpoints"]
            ),
            timeout=5,
            what=f"gateway slots freed: {eps}",
        )
        print(f"engine freed the request {freed:.3f} s after the client left")
        assert metric(g.url, "unbroken_gateway_client_disconnects_total") >= 1
    finally:
        g.stop()


async def test_a_refused_handover_leaves_the_stream_where_it_was(
    tmp_path: Path, engines: tuple[Proc, Proc]
) -> None:
    """The fallback, in one process: a handover whose target does not answer (no such
    socket) leaves the stream with its worker, which continues it by continuation after the
    cut, byte-exact, and counts why it kept it."""
    import asyncio

    import aiohttp

    from unbroken.config.spec import GatewaySettings
    from unbroken.gateway._handover import Outbound
    from unbroken.gateway._pool import State
    from unbroken.gateway._server import Gateway, StaticEndpoint
    from unbroken.wire.http import free_port

    e, _ = engines
    gw = Gateway(GatewaySettings(port=free_port(), admin_port=free_port()), "token")
    out: Outbound | None = None
    try:
        await gw.start([StaticEndpoint(e.url)])
        for _ in range(400):
            if any(x.state == State.READY for x in gw.pool.endpoints.values()):
                break
            await asyncio.sleep(0.025)
        prompt, n = "stay here", 400
        body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0}
        dec = SSEDecoder()
        texts: list[str] = []
        async with (
            aiohttp.ClientSession() as s,
            s.post(
                f"http://127.0.0.1:{gw.port}/v1/completions", json={**body, "stream": True}
            ) as r,
        ):
            assert r.status == 200
            async for chunk in r.content.iter_any():
                for ev in dec.feed(chunk):
                    if ev.data is None or ev.is_done:
                        continue
                    texts.append(ev.json()["choices"][0]["text"])
                if out is None and len(texts) >= 30:
                    out = Outbound(gw, [str(tmp_path / "nobody-listens.sock")])  # type: ignore[arg-type]
                    out.start()
        assert out is not None
        assert "".join(texts) == expected_completion(prompt, n).text
        assert out.handed == 0 and out.kept == {"refused": 1}, out.kept
        reg = gw.metrics.registry
        # Cut and continued here (a leg by continuation), not counted as a migration.
        assert reg.get_sample_value("unbroken_gateway_migration_path_total", {"path": "text"}) == 1
        assert (
            reg.get_sample_value("unbroken_gateway_streams_migrated_total", {"reason": "handover"})
            is None
        )
    finally:
        if out is not None:
            out.stop()
        await gw.stop()


def test_a_stream_that_cannot_move_finishes_in_the_old_worker(
    tmp_path: Path, engines: tuple[Proc, Proc]
) -> None:
    """The fallback in real processes: a stream with logprobs cannot be continued elsewhere,
    so its old worker keeps it (and lives until it ends, whole); the stream beside it is
    handed over. Both byte-exact."""
    from concurrent.futures import ThreadPoolExecutor

    from helpers import stream, stream_text

    a, b = engines
    g = gateway(tmp_path, a.url, b.url, args=("--workers", "2"))
    try:
        bodies = {
            "moves": {"model": MODEL, "prompt": "moves", "max_tokens": 1200, "temperature": 0},
            "stays": {
                "model": MODEL,
                "prompt": "stays",
                "max_tokens": 1200,
                "temperature": 0,
                "logprobs": 1,
            },
        }
        with ThreadPoolExecutor(2) as pool:
            jobs = {
                k: pool.submit(stream, g.url, "/v1/completions", body) for k, body in bodies.items()
            }
            wait_for(lambda: _running(a) + _running(b) == 2, timeout=30, what="both streaming")
            time.sleep(0.5)
            old = workers_of(g)["pids"]
            g.signal(signal.SIGHUP)
            wait_for(
                lambda: (
                    metric(g.url, "unbroken_gateway_streams_handed_over_total", direction="in") == 1
                ),
                timeout=30,
                what="one stream handed over",
            )
            assert not all(gone(p) for p in old)  # the logprobs stream's worker stays
            results = {k: j.result() for k, j in jobs.items()}
        for k, (events, r) in results.items():
            assert r.status_code == 200
            assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
            assert not any(isinstance(e, dict) and "error" in e for e in events), k
            assert stream_text(events, chat=False) == expected_completion(k, 1200).text, k
        lps = [e["choices"][0]["logprobs"] for e in results["stays"][0] if isinstance(e, dict)]
        assert all(lp and lp["tokens"] for lp in lps if lp is not None) and len(lps) >= 1200
        wait_for(lambda: all(gone(p) for p in old), timeout=10, what="old workers gone")
        assert metric(g.url, "unbroken_gateway_streams_handed_over_total", direction="out") == 1
    finally:
        g.stop()
