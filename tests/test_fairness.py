"""Fair queueing's reserve (issue 25): a tenant over its weighted share of a full pool leaves
the last slot to an active tenant under its share, so that tenant's next request finds a slot
at once instead of waiting behind the greedy tenant's streams. In process for the rule (one
admission, and two admissions sharing the workers' tables as two workers do); end to end
through a real gateway (two workers) and simulator for the light tenant's wait and for no
idle capacity with one tenant."""

from __future__ import annotations

import asyncio
import json
import os
import selectors
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from helpers import MODEL, engine, gateway, metric, ready_endpoint, wait_for
from test_gateway_workers import client_conns, workers_of
from test_tenants import KEYS, tenants_config
from unbroken.gateway import _admission, _fairshare
from unbroken.gateway._admission import Admission
from unbroken.gateway._pool import Endpoint, Pool
from unbroken.gateway._shared import SharedCounters, SharedSlot


def one_pool(cap: int, **kw: object) -> tuple[Pool, Endpoint, Admission]:
    pool = Pool(default_cap=cap)
    ep = ready_endpoint("e")
    pool.add(ep)
    return pool, ep, Admission(pool, queue_timeout=5.0, **kw)  # type: ignore[arg-type]


async def taken(adm: Admission, tenant: str, share: float = 1.0) -> tuple[Endpoint, int, float]:
    return await adm.acquire("m", "standard", tenant=tenant, share=share)


async def pending(adm: Admission, tenant: str, share: float = 1.0) -> asyncio.Task:  # type: ignore[type-arg]
    """A request that should queue: its task, checked not done after a moment."""
    t = asyncio.create_task(taken(adm, tenant, share))
    await asyncio.sleep(0.02)
    assert not t.done(), f"{tenant} got a slot it should have waited for"
    return t


def two_workers(
    tmp_path: Path, cap: int, queue_timeout: float = 5.0
) -> list[tuple[Endpoint, Admission]]:
    """Two admissions over one shared table (two workers' rows), each with its pool of one
    endpoint `e` whose slot count is shared."""
    path = tmp_path / "admission"
    SharedCounters(path, create=True).close()
    sides = []
    for row in (0, 1):
        sh = SharedCounters(path, row=row)
        pool = Pool(default_cap=cap)
        ep = ready_endpoint("e")
        ep.slot = SharedSlot(sh, 0)
        pool.add(ep)
        sides.append((ep, Admission(pool, queue_timeout=queue_timeout, shared=sh)))
    return sides


def test_over_share_tenant_leaves_the_last_slot_to_an_active_light_one() -> None:
    async def run() -> None:
        _, ep, adm = one_pool(4)
        # The light tenant has been active (a request a moment ago, done).
        e, n, _ = await taken(adm, "light")
        adm.release(e, n)
        got = [await taken(adm, "greedy") for _ in range(3)]
        assert ep.inflight == 3
        # The 4th slot is free, but it is light's reserve: greedy (3 > its share 2) waits.
        g4 = await pending(adm, "greedy")
        assert ep.inflight == 3
        # Light's request takes it at once (no wait).
        e, n, waited = await taken(adm, "light")
        assert waited == 0.0 and ep.inflight == 4
        # Light's request ends: its slot is kept for it again, not given to greedy's waiter.
        adm.release(e, n)
        await asyncio.sleep(0.02)
        assert not g4.done() and ep.inflight == 3
        # A greedy stream ends: greedy's waiter takes that slot (greedy keeps its 3).
        adm.release(*got[0][:2])
        e4, n4, _ = await asyncio.wait_for(g4, 1.0)
        assert ep.inflight == 3
        for e, n, _ in (*got[1:], (e4, n4, 0.0)):
            adm.release(e, n)
        assert ep.inflight == 0 and adm.fair().held.sum() == 0

    asyncio.run(run())


def test_one_active_tenant_takes_every_slot() -> None:
    """Work-conserving: no other tenant active, greedy fills the pool; a tenant active only
    longer ago than the window keeps nothing back."""

    async def run() -> None:
        _, ep, adm = one_pool(4)
        got = [await taken(adm, "greedy") for _ in range(4)]
        assert ep.inflight == 4
        for e, n, _ in got:
            adm.release(e, n)
        e, n, _ = await taken(adm, "light")
        adm.release(e, n)
        i = adm.fair().flow(1, "light", "default", 1.0)
        assert i is not None
        adm.fair().mark(i, time.monotonic() - _fairshare.RESERVE_WINDOW_S - 0.1)
        got = [await taken(adm, "greedy") for _ in range(4)]
        assert ep.inflight == 4

    asyncio.run(run())


def test_the_reserve_lapses_without_a_release(monkeypatch: pytest.MonkeyPatch) -> None:
    """A greedy waiter held back gets the slot once the light tenant has been idle for the
    window, though no slot frees meanwhile (nothing would wake it otherwise)."""
    monkeypatch.setattr(_fairshare, "RESERVE_WINDOW_S", 0.2)
    monkeypatch.setattr(_admission, "RESERVE_WINDOW_S", 0.2)

    async def run() -> None:
        _, ep, adm = one_pool(4)
        e, n, _ = await taken(adm, "light")
        adm.release(e, n)
        for _ in range(3):
            await taken(adm, "greedy")
        g4 = await pending(adm, "greedy")
        _, _, waited = await asyncio.wait_for(g4, 1.0)
        assert 0.1 < waited < 0.6 and ep.inflight == 4

    asyncio.run(run())


def test_shares_follow_weights() -> None:
    """cap 8, light holding 2 and active. Heavy of weight 3 (share 6 of 8) may take the last
    slot as its 6th; of weight 1 (share 4) it may not: light, under its share 4, is owed it."""

    async def run(heavy_weight: float) -> tuple[Endpoint, Admission]:
        _, ep, adm = one_pool(8)
        for _ in range(2):
            await taken(adm, "light")
        for _ in range(5):
            await taken(adm, "heavy", heavy_weight)
        assert ep.inflight == 7
        return ep, adm

    async def both() -> None:
        ep, adm = await run(3.0)
        await taken(adm, "heavy", 3.0)
        assert ep.inflight == 8
        ep, adm = await run(1.0)
        h = await pending(adm, "heavy")
        assert ep.inflight == 7
        await taken(adm, "light")  # within its share: the slot is its
        assert ep.inflight == 8
        h.cancel()

    asyncio.run(both())


def test_two_workers_share_the_counts(tmp_path: Path) -> None:
    """Two admissions over one shared table (two workers' rows): greedy in worker 0 leaves
    the last slot to light, whose requests come to worker 1."""

    async def run() -> None:
        (ep0, a0), (ep1, a1) = two_workers(tmp_path, 4)
        e, n, _ = await taken(a1, "light")
        a1.release(e, n)
        got = [await taken(a0, "greedy") for _ in range(3)]
        g4 = await pending(a0, "greedy")
        assert ep1.inflight == 3
        e, n, waited = await taken(a1, "light")
        assert waited == 0.0 and ep0.inflight == 4
        assert a0.fair().holding(a0.fair().flow(1, "light", "default", 1.0) or 0) == 1
        a1.release(e, n)
        a0.release(*got[0][:2])
        await asyncio.wait_for(g4, 1.0)  # worker 0's poll finds the slot greedy freed
        assert ep1.inflight == 3

    asyncio.run(run())


def test_weighted_turns_hold_across_two_workers(tmp_path: Path) -> None:
    """Two admissions over one shared table (two workers), cap 2: heavy (weight 2) queues 30
    in worker 0, light (weight 1) 30 in worker 1. The start tags are on one clock, and a
    slot freed in worker 0 waits for worker 1's poll when light's turn is first there: the
    first 12 served are 8 heavy and 4 light, as in one process. (Before, each worker had its
    own tags and a worker's release served its own waiters: heavy took every slot.)"""

    async def run() -> None:
        (_, a0), (_, a1) = two_workers(tmp_path, 2, queue_timeout=10.0)
        first = [await taken(a0, "x") for _ in range(2)]
        order: list[str] = []

        async def one(adm: Admission, tenant: str, share: float) -> None:
            e, n, _ = await taken(adm, tenant, share)
            order.append(tenant)
            await asyncio.sleep(0.01)
            adm.release(e, n)

        tasks = [asyncio.create_task(one(a0, "heavy", 2.0)) for _ in range(30)]
        tasks += [asyncio.create_task(one(a1, "light", 1.0)) for _ in range(30)]
        await asyncio.sleep(0.05)
        for e, n, _ in first:
            a0.release(e, n)
        await asyncio.gather(*tasks)
        assert order[:12].count("heavy") == 8, order[:12]
        fair = a0.fair()
        assert not fair.queued.any() and not fair.low.any()  # every waiter uncounted

    asyncio.run(run())


def test_a_tenant_queued_in_another_worker_does_not_jump_its_turn(tmp_path: Path) -> None:
    """Light has waiters in worker 1: its next request to worker 0 queues behind them (worker
    0 holds none of light's), while a tenant idle everywhere takes a free slot at once. A
    flow idle again starts at the class's virtual time."""

    async def run() -> None:
        (_, a0), (_, a1) = two_workers(tmp_path, 1)
        e, n, _ = await taken(a0, "x")
        light1 = await pending(a1, "light")
        light0 = await pending(a0, "light")
        a0.release(e, n)
        await asyncio.sleep(0.1)
        assert light1.done() and not light0.done()  # the earlier tag, in the other worker
        e, n, _ = light1.result()
        a1.release(e, n)
        e, n, _ = await asyncio.wait_for(light0, 1.0)
        fair = a0.fair()
        f = fair._aux_index("tag", 1, "light")
        assert f is not None and fair.waiting(1, f) == 0
        a0.release(e, n)
        # Idle everywhere: a new light request takes the free slot (no queue, no debt).
        e, n, waited = await taken(a1, "light")
        assert waited == 0.0
        a1.release(e, n)

    asyncio.run(run())


def test_a_dead_workers_waiters_hold_no_one_up(tmp_path: Path) -> None:
    """Worker 1 queues light's waiters and dies: once the main process clears its row,
    worker 0's heavy waiter with a tag above light's first takes a freed slot at once (no
    DEFER_S for a worker that will never poll), and light's tag flow counts no waiter."""

    async def run() -> None:
        (_, a0), (_, a1) = two_workers(tmp_path, 1)
        e, n, _ = await taken(a0, "x")
        lights = [await pending(a1, "light") for _ in range(3)]  # tags 0, 1, 2
        heavy = [await pending(a0, "heavy") for _ in range(2)]  # tags 0, 1
        assert a1._poller is not None
        a1._poller.cancel()  # worker 1 dies: it polls no more ...
        a0.shared.clear_row(1)  # type: ignore[union-attr]  # ... and main clears its row
        a0.release(e, n)
        e, n, _ = await asyncio.wait_for(heavy[0], 1.0)  # a tie with light's first
        a0.release(e, n)
        t = time.monotonic()
        await asyncio.wait_for(heavy[1], 1.0)  # above light's 0, which no longer counts
        assert time.monotonic() - t < _admission.DEFER_S / 2
        fair = a0.fair()
        f = fair._aux_index("tag", 1, "light")
        assert f is not None and fair.waiting(1, f) == 0
        assert fair.lowest_elsewhere(1, fair.low_group(1, "default") or 0) == float("inf")
        for t2 in lights:
            t2.cancel()

    asyncio.run(run())


def test_small_pools_keep_nothing_back() -> None:
    """Under 4 slots, one kept back would be a third of the pool or more: none is."""

    async def run() -> None:
        _, ep, adm = one_pool(3)
        e, n, _ = await taken(adm, "light")
        adm.release(e, n)
        for _ in range(3):
            await taken(adm, "greedy")
        assert ep.inflight == 3

    asyncio.run(run())


def test_requests_without_tenants_are_unaffected() -> None:
    async def run() -> None:
        _, ep, adm = one_pool(2)
        await adm.acquire("m", "standard")
        _, n, _ = await adm.acquire("m", "standard")
        assert ep.inflight == 2 and type(n) is int and adm._fair is None

    asyncio.run(run())


# -- end to end: a real gateway with two workers, a real simulator ----------------------------
def _hog(url: str, key: str, stop: threading.Event, max_tokens: int) -> None:
    with httpx.Client(timeout=60) as c:
        while not stop.is_set():
            c.post(
                url + "/v1/completions",
                headers={"Authorization": f"Bearer {key}"},
                json={"model": MODEL, "prompt": "hog", "max_tokens": max_tokens},
            )


def _ttft(url: str, key: str) -> float:
    t0 = time.perf_counter()
    with httpx.stream(
        "POST",
        url + "/v1/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": MODEL, "prompt": "light", "max_tokens": 4, "stream": True},
        timeout=60,
    ) as r:
        assert r.status_code == 200
        first = None
        for line in r.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - t0
    assert first is not None
    return first


def test_light_tenant_is_not_queued_behind_a_full_pool_of_greedy_streams(tmp_path: Path) -> None:
    """cap 4, 2 workers; greedy keeps 10 streams of ~1.5 s in flight. Light's first request
    waits for a greedy stream to end (light was not active); its next ones find the slot
    greedy leaves them (TTFT far below a greedy stream's length), and while light is active
    greedy runs 3 streams, not 4. Greedy alone: all 4 slots run."""
    e = engine(tmp_path, "--decode-base-s", "0.02", "--max-num-seqs", "8", fast=False)
    cfg = tenants_config(
        tmp_path / "gw.json",
        [
            {"name": "light", "key": KEYS["acme"]},
            {"name": "greedy", "key": KEYS["beta"]},
        ],
        queue_timeout_s=60,
    )
    spread = ("--accept-pack-cpu", "0")  # both workers serve (no packing under light load)
    g = gateway(
        tmp_path, e.url, args=("--config", str(cfg), "--workers", "2", "--cap", "4", *spread)
    )
    stop = threading.Event()
    hogs = [
        threading.Thread(target=_hog, args=(g.url, KEYS["beta"], stop, 75), daemon=True)
        for _ in range(10)
    ]
    try:
        for t in hogs:
            t.start()
        # Greedy alone: every slot runs (the engine's running count reaches the cap).
        deadline = time.monotonic() + 10
        most = 0.0
        while time.monotonic() < deadline and most < 4:
            most = max(most, metric(e.url, "vllm:num_requests_running"))
            time.sleep(0.05)
        assert most == 4
        _ttft(g.url, KEYS["acme"])  # light becomes active (this one may wait)
        ttfts = []
        for _ in range(5):
            ttfts.append(_ttft(g.url, KEYS["acme"]))
            time.sleep(0.2)
        assert max(ttfts) < 0.5, ttfts  # a greedy stream lasts ~1.5 s
        waited = metric(
            g.url, "unbroken_gateway_tenant_queue_wait_seconds_bucket", tenant="light", le="0.01"
        )
        assert waited >= 5
    finally:
        stop.set()
        for t in hogs:
            t.join(timeout=10)
        g.stop()
        e.stop()


def _connect_to(g_port: int, pids: tuple[int, int], to: int, n: int) -> list[socket.socket]:
    """`n` connections accepted by worker `to`: the other is stopped while it accepts them."""
    other = pids[0] if to == pids[1] else pids[1]
    before = client_conns(pids, g_port)[to]
    os.kill(other, signal.SIGSTOP)
    try:
        socks = [socket.create_connection(("127.0.0.1", g_port)) for _ in range(n)]
        wait_for(lambda: client_conns(pids, g_port)[to] == before + n, timeout=30)
    finally:
        os.kill(other, signal.SIGCONT)
    return socks


def test_weighted_turns_hold_across_worker_processes(tmp_path: Path) -> None:
    """The reviewer's case, with its connections on both workers by construction: cap 2,
    heavy (weight 2) and light (weight 1) send 30 requests each at once, heavy's all
    accepted by one worker and light's by the other (the other worker SIGSTOPped meanwhile).
    Of the 12 that finish after the first two, heavy has 7-9, and 14-18 of 24 (8 and 16 in
    one process). Before, each worker kept its own tags and served the slots it freed to its
    own waiters: 6:6, 12:0 or 0:12 here; with connections spread by the kernel, runs went
    2:10 to 8:4."""
    e = engine(tmp_path, "--decode-base-s", "0.01", "--max-num-seqs", "8", fast=False)
    cfg = tenants_config(
        tmp_path / "gw.json",
        [
            {"name": "heavy", "key": KEYS["acme"], "weight": 2},
            {"name": "light", "key": KEYS["beta"], "weight": 1},
        ],
        queue_timeout_s=60,
    )
    g = gateway(tmp_path, e.url, args=("--config", str(cfg), "--workers", "2", "--cap", "2"))
    socks: list[socket.socket] = []
    try:
        pids = tuple(workers_of(g)["pids"])
        assert len(pids) == 2
        heavy = _connect_to(g.port, pids, pids[0], 30)  # type: ignore[arg-type]
        light = _connect_to(g.port, pids, pids[1], 30)  # type: ignore[arg-type]
        socks = heavy + light
        body = json.dumps({"model": MODEL, "prompt": "go", "max_tokens": 10}).encode()

        def request(key: str) -> bytes:
            head = (
                f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n"
            )
            return head.encode() + body

        sel = selectors.DefaultSelector()
        got: dict[socket.socket, bytes] = {}
        for sk, name, key in [(s, "h", KEYS["acme"]) for s in heavy] + [
            (s, "l", KEYS["beta"]) for s in light
        ]:
            sk.sendall(request(key))
            sel.register(sk, selectors.EVENT_READ, name)
            got[sk] = b""
        order = []
        deadline = time.monotonic() + 60
        while len(order) < 60 and time.monotonic() < deadline:
            for k, _ in sel.select(timeout=1):
                sk = k.fileobj
                assert isinstance(sk, socket.socket)
                data = sk.recv(65536)
                got[sk] += data
                if not data:  # the answer is whole (Connection: close)
                    sel.unregister(sk)
                    assert got[sk].startswith(b"HTTP/1.1 200"), got[sk][:200]
                    order.append(k.data)
        assert len(order) == 60, order
        # 8 of 12 and 16 of 24 in one process (heavy has 30: none runs out by then).
        assert 7 <= order[2:14].count("h") <= 9, "".join(order)
        assert 14 <= order[2:26].count("h") <= 18, "".join(order)
    finally:
        for sk in socks:
            sk.close()
        g.stop()
        e.stop()
