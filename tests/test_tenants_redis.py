"""Tenants' limits across gateway replicas sharing a Redis (`rate_limit.store: redis`), and
the Redis-down path: requests keep being served on local shares, said once in the log, and
said once again when the store is back. redis-server is the distribution's (bootstrap
installs it), started here on a free port with its own directory."""

from __future__ import annotations

import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from helpers import Proc, engine, gateway, metric
from test_tenants import KEYS, _burst, complete, tenants_config
from unbroken.wire.http import free_port

REDIS = shutil.which("redis-server")
pytestmark = pytest.mark.skipif(
    REDIS is None, reason="redis-server is not installed (scripts/bootstrap.sh installs it)"
)


class Redis:
    def __init__(self, tmp: Path) -> None:
        self.port = free_port()
        self.dir = tmp / "redis"
        self.dir.mkdir(exist_ok=True)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> Redis:
        assert REDIS is not None
        self.proc = subprocess.Popen(
            [
                REDIS,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.dir),
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "no",
            ],
            stdout=open(self.dir / "redis.log", "ab"),
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 10
        import socket

        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[Redis]:
    r = Redis(tmp_path).start()
    yield r
    r.kill()


def _gateways(tmp: Path, eng: Proc, cfg: Path, n: int = 2) -> list[Proc]:
    return [
        gateway(
            tmp,
            eng.url,
            # Both workers serve (no packing under light load): limits held across them too.
            args=("--config", str(cfg), "--workers", "2", "--accept-pack-cpu", "0"),
            name=f"gw{i}",
        )
        for i in range(n)
    ]


def _burst_many(gs: list[Proc], key: str, n: int, max_tokens: int = 2) -> list[int]:
    """`n` requests at once, spread over the gateways `gs`; their statuses."""
    out: list[int] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        r = complete(gs[i % len(gs)], key, max_tokens)
        with lock:
            out.append(r.status_code)

    ts = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return sorted(out)


def test_limits_exact_across_two_replicas(tmp_path: Path, redis: Redis) -> None:
    """Two gateways of two workers each, one Redis: rpm 12 and 3 concurrent streams hold
    for the tenant as a whole, exactly (local shares would give 6 + 6 and 2 + 1 per
    replica, too few for a burst that lands on one of them)."""
    e = engine(tmp_path, "--decode-base-s", "0.02", fast=False)
    cfg = tenants_config(
        tmp_path / "gw.json",
        [
            {"name": "acme", "key": KEYS["acme"], "limits": {"requests_per_minute": 12}},
            {"name": "beta", "key": KEYS["beta"], "limits": {"concurrent_streams": 3}},
        ],
        rate_limit={"store": "redis", "redis_url": redis.url, "redis_timeout_s": 0.5},
    )
    gs = _gateways(tmp_path, e, cfg)
    try:
        codes = _burst_many(gs, KEYS["acme"], 40)
        assert codes == [200] * 12 + [429] * 28, codes
        # All 12 on one replica: still 12 in all (the shared count, not a local share).
        codes = _burst_many(gs[:1], KEYS["acme"], 5)
        assert codes == [429] * 5
        codes = _burst_many(gs, KEYS["beta"], 8, max_tokens=60)
        assert codes == [200] * 3 + [429] * 5, codes
        assert _burst_many(gs, KEYS["beta"], 3) == [200] * 3  # the streams' slots are back
    finally:
        for g in gs:
            g.stop()
        e.stop()


def test_redis_down_keeps_serving_and_says_so_once(tmp_path: Path, redis: Redis) -> None:
    e = engine(tmp_path)
    cfg = tenants_config(
        tmp_path / "gw.json",
        [
            {
                "name": "acme",
                "key": KEYS["acme"],
                "limits": {"requests_per_minute": 100_000, "concurrent_streams": 50},
            }
        ],
        rate_limit={"store": "redis", "redis_url": redis.url, "redis_timeout_s": 0.2},
    )
    (g,) = _gateways(tmp_path, e, cfg, n=1)
    try:
        assert _burst(g, KEYS["acme"], 8) and all(
            r.status_code == 200 for r in _burst(g, KEYS["acme"], 8)
        )
        redis.kill()
        slow = 0.0
        for _ in range(30):  # every request served, none waiting on the dead store
            t0 = time.monotonic()
            r = complete(g, KEYS["acme"])
            slow = max(slow, time.monotonic() - t0)
            assert r.status_code == 200, r.text
            assert r.headers["x-ratelimit-limit-requests"] == "100000"
        assert slow < 1.0, slow
        log = g.tail(100_000)
        assert log.count("unreachable") == 1, log
        assert "is back:" not in log
        redis.start()  # same port, empty
        deadline = time.monotonic() + 10
        while "is back:" not in g.tail(100_000) and time.monotonic() < deadline:
            assert complete(g, KEYS["acme"]).status_code == 200
            time.sleep(0.2)
        log = g.tail(100_000)
        assert log.count("is back:") == 1 and log.count("unreachable") == 1, log
        assert all(r.status_code == 200 for r in _burst(g, KEYS["acme"], 8))
        assert metric(g.url, "unbroken_gateway_tenant_requests_total", tenant="acme") >= 55
        assert httpx.get(g.url + "/health").status_code == 200
    finally:
        g.stop()
        e.stop()


def test_one_slow_store_answer_is_not_an_outage() -> None:
    """A store that accepts connections and never answers (a black hole, as a stalled Redis
    looks): a single timed-out call decides that request on local shares without marking
    the store down; three in a row do. In process; the listener is a real socket."""
    import asyncio
    import socket

    from unbroken.gateway._ratelimit import TIMEOUTS_DOWN, RedisStore, TenantTable

    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(16)
    port = hole.getsockname()[1]

    async def go() -> list[int]:
        table = TenantTable()
        store = RedisStore(f"redis://127.0.0.1:{port}/0", 0.05, table)
        store._warm = asyncio.get_running_loop().create_future()  # no script loading
        store._warm.set_result(None)
        flags = []
        for _ in range(TIMEOUTS_DOWN):
            assert await store.admit("t", [10, None, None], None) is None
            flags.append(int(table.flags[0]))
        for t in (store._probe, store._alive):
            if t is not None:
                t.cancel()
        await store.r.aclose()
        return flags

    try:
        flags = asyncio.run(go())
    finally:
        hole.close()
    assert flags == [0] * (TIMEOUTS_DOWN - 1) + [1]
