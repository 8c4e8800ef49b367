"""LoRA adapter affinity (gateway/_adapters.py): vllm:lora_requests_info as the prober reads
it, the policy's narrowing in process, then a real gateway in front of two LoRA engines
(adapters loaded at start and at runtime)."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import httpx
import orjson
from prometheus_client import generate_latest

from helpers import FAST, TOKEN, Proc, admin, gateway, ready_endpoint, wait_for
from unbroken.engine import expected_completion
from unbroken.engine.metrics import EngineMetrics
from unbroken.gateway._adapters import AdapterAffinity, LoraInfo, parse_lora_info
from unbroken.gateway._affinity import CacheAware
from unbroken.gateway._pool import Endpoint, LeastLoad, PickRequest, Pool
from unbroken.gateway._routing import RoundRobin
from unbroken.wire.http import free_port


def _lora(running: str = "", waiting: str = "", max_lora: int = 1, recent: str = "") -> LoraInfo:
    def names(s: str) -> frozenset[str]:
        return frozenset(filter(None, s.split(",")))

    return LoraInfo(max_lora, names(running), names(waiting), names(recent) | names(running), 1.0)


def _ep(name: str, inflight: int = 0, lora: LoraInfo | None = None) -> Endpoint:
    e = ready_endpoint(name, inflight=inflight)
    e.models |= {"a1", "a2", "a3"}
    e.adapters = {"a1": "m", "a2": "m", "a3": "m"}
    e.lora = lora
    return e


def _pool(*eps: Endpoint, policy: object | None = None) -> Pool:
    pool = Pool(64, policy)  # type: ignore[arg-type]
    for e in eps:
        pool.add(e)
    return pool


# -- the metric -----------------------------------------------------------------------------------
def test_parse_lora_info_takes_the_latest_sample_and_recent_history() -> None:
    m = EngineMetrics("m", max_loras=2)
    assert m.lora is not None
    page = generate_latest(m.registry).decode()
    info = parse_lora_info(page)  # the simulator's first sample, before any step: idle
    assert info is not None and info.max_lora == 2 and not info.running and info.free_slot()
    # Registered with no sample (vLLM before its first step): LoRA on, nothing known.
    bare = "# HELP vllm:lora_requests_info x\n# TYPE vllm:lora_requests_info gauge\n"
    info = parse_lora_info(bare)
    assert info is not None and info.max_lora is None and info.free_slot()
    m.lora.record({"old": 1}, {})
    m.lora.gauge.labels("2", "", "old").set(time.time() - 120)  # two minutes ago
    m.lora.record({"a1": 2, "b,x": 1}, {"a2": 1})  # a name with a comma splits (as in vLLM)
    m.lora.record({"a1": 1}, {"a2": 3})
    info = parse_lora_info(generate_latest(m.registry).decode())
    assert info is not None
    assert info.max_lora == 2 and info.running == {"a1"} and info.waiting == {"a2"}
    assert info.recent == {"a1", "b", "x"}  # "old" ran long before the latest step
    assert info.has("a2") and info.has("b") and not info.has("old")
    assert info.free_slot()  # one adapter running of 2
    assert LoraInfo.from_dict(orjson.loads(orjson.dumps(info.as_dict()))) == info
    assert parse_lora_info("vllm:num_requests_waiting 0\n") is None  # LoRA off
    # Quoted and escaped label values.
    odd = (
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="q\\"x,y",'
        'waiting_lora_adapters=""} 5.0\n'
    )
    info = parse_lora_info(odd)
    assert info is not None and info.running == {'q"x', "y"} and info.max_lora == 4


def test_the_engine_keeps_a_bounded_history_of_label_sets() -> None:
    m = EngineMetrics("m", max_loras=1)
    assert m.lora is not None
    for i in range(100):
        m.lora.record({f"a{i}": 1}, {})
    page = generate_latest(m.registry).decode()
    assert page.count("vllm:lora_requests_info{") == m.lora.keep
    assert 'running_lora_adapters="a99"' in page and 'running_lora_adapters="a0"' not in page


# -- the policy -----------------------------------------------------------------------------------
def test_an_adapter_goes_where_it_is_loaded_within_the_load_bound() -> None:
    x, y, z = _ep("x", inflight=5, lora=_lora("a1")), _ep("y"), _ep("z")
    pool = _pool(x, y, z)
    assert isinstance(pool.policy, AdapterAffinity)
    assert pool.pick("a1", "standard") is x  # busier, but a1 runs there
    assert pool.pick("m", "standard") in (y, z)  # the base model: least load, untouched
    x.slot.add(10)  # now 15 in flight: past 0 x 1.25 + 8
    assert pool.pick("a1", "standard") in (y, z)
    # Waiting there counts as loaded too (it is being loaded into a slot).
    x.slot.add(-15)
    x.lora = _lora(waiting="a2")
    x.slot.add(3)
    assert pool.pick("a2", "standard") is x


def test_a_new_adapter_avoids_replicas_whose_slots_are_full() -> None:
    x = _ep("x", lora=_lora("a1", max_lora=1))
    y = _ep("y", inflight=4, lora=_lora("a2", max_lora=2))
    z = _ep("z", inflight=9, lora=_lora("a1,a2", max_lora=2))
    pool = _pool(x, y, z)
    # a3 is loaded nowhere; x (idle) and z have no free slot, y has one.
    assert pool.pick("a3", "standard") is y
    # With every slot full, load decides.
    y.lora = _lora("a1,a2", max_lora=2)
    assert pool.pick("a3", "standard") is x


def test_where_this_gateway_sent_an_adapter_counts_without_engine_metrics() -> None:
    x, y = _ep("x"), _ep("y")
    pool = _pool(x, y, policy=LeastLoad())
    first = pool.pick("a1", "standard")
    assert first is not None
    pool.admitted(first, "a1", "standard", None)
    first.slot.add(3)  # it is busier now, and least load alone would go elsewhere
    for _ in range(3):
        assert pool.pick("a1", "standard") is first
    assert pool.pick("m", "standard") is not first
    pool.remove(first.name)
    assert first.name not in pool.policy.as_dict().get("a1", [])  # type: ignore[attr-defined]


def test_it_wraps_the_configured_policy() -> None:
    """The configured policy still chooses among the narrowed candidates, keeps its own
    interface (pick_route only where it has one) and its attributes."""
    rr = AdapterAffinity(RoundRobin())
    assert not hasattr(rr, "pick_route")
    ca = AdapterAffinity(CacheAware())
    assert hasattr(ca, "pick_route") and ca.wants_hint and ca.index is ca.inner.index  # type: ignore[attr-defined]
    x, y, z = _ep("x"), _ep("y", lora=_lora("a1")), _ep("z", lora=_lora("a1"))
    pool = _pool(x, y, z, policy=RoundRobin())
    got = {pool.pick("a1", "standard").name for _ in range(6)}  # type: ignore[union-attr]
    assert got == {"y", "z"}  # round robin within the warm ones
    assert {pool.pick("m", "standard").name for _ in range(6)} == {"x", "y", "z"}  # type: ignore[union-attr]
    # One candidate: nothing to narrow.
    assert AdapterAffinity(LeastLoad()).narrow([x], "a1") == [x]
    req = PickRequest("a1", "standard")
    assert ca.pick([x, y], req) is y


# -- a real gateway --------------------------------------------------------------------------------
def lora_engine(tmp: Path, *args: str, name: str, env: dict[str, str] | None = None) -> Proc:
    port = free_port()
    argv = [sys.executable, "-m", "unbroken.engine", "--port", str(port), *FAST, *args]
    return Proc(
        argv, port, tmp / f"{name}-{port}.log", env={"UNBROKEN_ADMIN_TOKEN": TOKEN, **(env or {})}
    ).start()


def _post(g: Proc, model: str, n: int = 4) -> httpx.Response:
    body = {"model": model, "prompt": "route me", "max_tokens": n, "temperature": 0}
    return httpx.post(g.url + "/v1/completions", json=body, timeout=30)


def test_a_gateway_routes_adapters_to_where_they_run_and_learns_runtime_adapters(
    tmp_path: Path,
) -> None:
    lora = ("--served-model-name", "base", "--enable-lora", "--max-loras", "1")
    mods = ("--lora-modules", "a1=/l/a1", "a2=/l/a2")
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}
    a = lora_engine(tmp_path, *lora, *mods, name="a", env=env)
    b = lora_engine(tmp_path, *lora, *mods, name="b", env=env)
    cfg = tmp_path / "gw.yaml"
    cfg.write_text("probe_interval_s: 0.1\n")
    g = gateway(tmp_path, a.url, b.url, args=("--config", str(cfg)))
    names = {a.url.split("://")[1]: a, b.url.split("://")[1]: b}
    stop = threading.Event()
    try:
        listed = httpx.get(g.url + "/v1/models").json()["data"]
        cards = {c["id"]: c for c in listed}
        assert cards["a1"]["parent"] == "base" and cards["a1"]["root"] == "/l/a1"
        # In the engine's order (base first: scripts take data[0] as the model), not sorted.
        direct = httpx.get(a.url + "/v1/models").json()["data"]
        assert [c["id"] for c in listed] == [c["id"] for c in direct] == ["base", "a1", "a2"]
        # A long a1 stream holds one engine's only LoRA slot.
        held: list[str] = []

        def hold() -> None:
            body = {"model": "a1", "prompt": "long", "max_tokens": 3000, "stream": True}
            with httpx.stream("POST", g.url + "/v1/completions", json=body, timeout=60) as r:
                held.append(r.headers["X-Unbroken-Endpoint"])
                for _ in r.iter_raw():
                    if stop.is_set():
                        return

        t = threading.Thread(target=hold, daemon=True)
        t.start()
        wait_for(lambda: held, what="the a1 stream")
        x = held[0]
        (y,) = set(names) - {x}

        def scraped(name: str) -> dict | None:
            eps = admin(g, "GET", "/admin/endpoints").json()["endpoints"]
            return next(e for e in eps if e["name"] == name)["lora"]

        wait_for(lambda: (scraped(x) or {}).get("running") == ["a1"], what=lambda: str(scraped(x)))
        # a2 would wait for x's slot: it goes to y. a1 runs on x: it goes there, busier or not.
        for _ in range(3):
            r = _post(g, "a2")
            assert r.status_code == 200 and r.headers["X-Unbroken-Endpoint"] == y
            assert (
                r.json()["choices"][0]["text"]
                == expected_completion("route me", 4, adapter="a2").text
            )
        for _ in range(3):
            r = _post(g, "a1")
            assert r.status_code == 200 and r.headers["X-Unbroken-Endpoint"] == x
            assert (
                r.json()["choices"][0]["text"]
                == expected_completion("route me", 4, adapter="a1").text
            )
        r = _post(g, "base")
        assert r.json()["choices"][0]["text"] == expected_completion("route me", 4).text

        # An adapter loaded at runtime on y alone: the gateway learns it from y's /v1/models.
        assert _post(g, "a3").status_code == 404
        r = httpx.post(
            names[y].url + "/v1/load_lora_adapter", json={"lora_name": "a3", "lora_path": "/l/a3"}
        )
        assert r.status_code == 200
        wait_for(lambda: _post(g, "a3").status_code == 200, timeout=5, what="a3 served")
        for _ in range(3):
            r = _post(g, "a3")
            assert r.headers["X-Unbroken-Endpoint"] == y
            assert (
                r.json()["choices"][0]["text"]
                == expected_completion("route me", 4, adapter="a3").text
            )
        assert "a3" in {c["id"] for c in httpx.get(g.url + "/v1/models").json()["data"]}
        eps = {e["name"]: e for e in admin(g, "GET", "/admin/endpoints").json()["endpoints"]}
        assert eps[y]["adapters"] == {"a1": "base", "a2": "base", "a3": "base"}
        httpx.post(names[y].url + "/v1/unload_lora_adapter", json={"lora_name": "a3"})
        wait_for(lambda: _post(g, "a3").status_code == 404, timeout=5, what="a3 gone")
        err = orjson.loads(_post(g, "a3").content)["error"]
        assert err["param"] == "model" or "a3" in err["message"]
    finally:
        stop.set()
        g.stop()
        a.stop()
        b.stop()


def test_an_adapter_loaded_at_runtime_is_served_from_its_first_request(tmp_path: Path) -> None:
    """vLLM serves an adapter from the moment `/v1/load_lora_adapter` answers. The gateway
    learnt it only at a probe, and on real vLLM only once `vllm:lora_requests_info` shows
    (after the engine's first request): its first requests got 404 (the LoRA tests,
    now in tests/vllm/test_vllm_canonical.py, found it). Now a request for a model no
    endpoint is known to serve has the engines' models read first. Probes 60 s apart here,
    so they cannot be what learns it; one worker, and two (the main process reads for the
    workers)."""
    lora = ("--served-model-name", "base", "--enable-lora", "--max-loras", "1")
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}
    e = lora_engine(tmp_path, *lora, "--lora-modules", "a1=/l/a1", name="e", env=env)
    cfg = tmp_path / "gw.yaml"
    cfg.write_text("probe_interval_s: 60\n")
    try:
        for i, workers in enumerate(("1", "2")):
            g = gateway(tmp_path, e.url, args=("--config", str(cfg), "--workers", workers))
            try:
                name = f"runtime{i}"
                assert _post(g, name).status_code == 404  # not loaded yet: read, then 404
                r = httpx.post(
                    e.url + "/v1/load_lora_adapter",
                    json={"lora_name": name, "lora_path": f"/l/{name}"},
                )
                assert r.status_code == 200, r.text
                time.sleep(0.1)  # past MODELS_FRESH_S since the read of the 404 above
                for _ in range(2):
                    r = _post(g, name)
                    assert r.status_code == 200, (workers, r.text)
                    want = expected_completion("route me", 4, adapter=name).text
                    assert r.json()["choices"][0]["text"] == want
                r = _post(g, "never-loaded")
                assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
            finally:
                g.stop()
    finally:
        e.stop()
