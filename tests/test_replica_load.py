"""Gateway replicas see each other's load on the engines: each counts only its own legs in
flight, and takes the rest of what an engine holds from its scrape (`Endpoint.foreign`:
running + waiting - in flight here), so a replica does not pile new work onto an engine
another replica already keeps busy.

The arithmetic in process; then real processes: two simulated engines, gateway A in front of
engine X alone holding long streams there, gateway B in front of both."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from helpers import MODEL, Proc, admin, engine, gateway, ready_endpoint, wait_for
from unbroken.gateway._affinity import AffinitySettings, CacheAware, home
from unbroken.gateway._main_gateway import STATE_S
from unbroken.gateway._pool import KV_WEIGHT, PickRequest
from unbroken.gateway._prefix import hint_of


@pytest.mark.parametrize(
    ("inflight", "waiting", "running", "kv", "foreign", "load"),
    [
        (0, 0, 0, 0.0, 0, 0),  # idle
        (5, 0, 5, 0.0, 0, 5),  # one gateway: the engine holds what it sent
        (5, 0, 3, 0.0, 0, 5),  # some of its legs not at the engine yet (never below 0)
        (2, 0, 9, 0.0, 7, 9),  # another replica's 7 streams there
        (2, 4, 9, 0.0, 11, 13),  # another's streams and a queue: the queue counted once
        (6, 4, 2, 0.0, 0, 10),  # its own requests queued there: the queue as before
        (0, 0, 3, 0.5, 3, 3 + KV_WEIGHT * 0.5),  # clients of the engine's own, a half-full KV
    ],
)
def test_load_counts_what_the_engine_holds_beyond_this_gateway(
    inflight: int, waiting: float, running: float, kv: float, foreign: float, load: float
) -> None:
    e = ready_endpoint("e", inflight=inflight)
    e.scraped(waiting, running, kv)
    assert e.foreign == foreign
    assert e.load == pytest.approx(load)


def test_a_session_home_full_of_another_replicas_streams_is_full() -> None:
    """The session's bound counts every candidate's `foreign`: a home that another replica
    filled is not credited, as it would not be in one gateway that saw it all."""
    pol = CacheAware(affinity=AffinitySettings(use_prefix=False))
    a, b = ready_endpoint("a"), ready_endpoint("b")
    s = next(f"s{i}" for i in range(100) if home(f"s{i}".encode(), [a, b]) is a)
    req = PickRequest(
        "m", "standard", hint_of({"prompt": "x"}, False, "m", block_chars=64, session=s)
    )
    assert pol.pick([a, b], req) is a
    a.scraped(0, 20, 0.0)  # another replica's 20 streams at the home, none here
    assert pol.pick([a, b], req) is b


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[list[Proc]]:
    # A KV cache the held streams barely touch: the KV term of the load leaves them unseen.
    engs = [engine(tmp_path, "--kv-capacity-tokens", "4000000", name=f"e{i}") for i in range(2)]
    yield engs
    for e in engs:
        e.stop()


def _hold(url: str, n: int, stop: threading.Event) -> list[threading.Thread]:
    """`n` long streams through `url`, each read until `stop` (then dropped)."""

    def one() -> None:
        body = {"model": MODEL, "prompt": "hold", "max_tokens": 16000, "ignore_eos": True,
                "stream": True}  # fmt: skip
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for _ in r.iter_bytes():
                if stop.is_set():
                    return

    threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


@pytest.mark.parametrize("workers", [1, 2])
def test_a_replica_sends_new_work_away_from_another_replicas_streams(
    tmp_path: Path, engines: list[Proc], workers: int
) -> None:
    x, y = engines
    cfg = tmp_path / "gw.yaml"
    cfg.write_text("probe_interval_s: 0.2\nrouting: least_load\n")
    a = gateway(tmp_path, x.url, args=("--config", str(cfg)), name="a")
    b = gateway(tmp_path, x.url, y.url, args=("--config", str(cfg), "--workers", str(workers)),
                name="b")  # fmt: skip
    stop = threading.Event()
    threads = _hold(a.url, 8, stop)
    try:

        def foreign_at_x() -> float:
            eps = admin(b, "GET", "/admin/endpoints").json()["endpoints"]
            return next(e["foreign"] for e in eps if e["url"] == x.url)

        wait_for(lambda: foreign_at_x() >= 8, timeout=15, what=lambda: b.tail(20))
        time.sleep(2 * STATE_S)  # with workers, the main process's next state reaches them
        # B's own long streams: without A's streams in its view, least load spreads them
        # evenly (3 and 3); with them, Y takes all six before it is as loaded as X.
        threads += _hold(b.url, 6, stop)

        def inflight() -> dict[str, int]:
            eps = admin(b, "GET", "/admin/endpoints").json()["endpoints"]
            return {("x" if e["url"] == x.url else "y"): e["inflight"] for e in eps}

        wait_for(lambda: sum(inflight().values()) == 6, timeout=15, what=lambda: str(inflight()))
        assert inflight() == {"x": 0, "y": 6}
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=10)
        a.stop()
        b.stop()
