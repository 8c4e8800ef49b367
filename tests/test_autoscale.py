"""Autoscaling (issue 24): the autoscaler's rule in-process, then a real `unbroken up` whose
pools grow under a burst (in proportion, the sleeping fallback woken by what the full primary
cannot hold) and shrink after a quiet period, one replica at a time through drain and
migration, with every stream byte-exact."""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from helpers import MODEL, Up, wait_for
from unbroken.config.spec import SpecError, parse_spec
from unbroken.controller.autoscale import Autoscaler, PoolScaling
from unbroken.controller.scaling import parse_demand
from unbroken.engine.textmodel import expected_completion
from unbroken.wire.sse import SSEDecoder


def _scaler(**kw: Any) -> Autoscaler:
    base: dict[str, Any] = dict(
        name="p", min=1, max=6, target=10.0, up_cooldown_s=2.0, down_quiet_s=5.0,
        down_cooldown_s=1.0,
    )  # fmt: skip
    base.update(kw)
    return Autoscaler([PoolScaling(**base)])


def test_scale_up_is_proportional_and_bounded() -> None:
    a = _scaler()
    (d,) = a.step(0.0, {"p": 35.0}, {"p": 1})
    assert (d.current, d.desired, d.direction) == (1, 4, "up")  # ceil(35/10), in one step
    (d,) = a.step(10.0, {"p": 500.0}, {"p": 4})
    assert d.desired == 6  # max


def test_up_cooldown_then_more() -> None:
    a = _scaler()
    assert a.step(0.0, {"p": 25.0}, {"p": 1})[0].desired == 3
    assert a.step(1.0, {"p": 45.0}, {"p": 3}) == []  # within the 2 s cool-down
    assert a.step(2.0, {"p": 45.0}, {"p": 3})[0].desired == 5


def test_tolerance_keeps_the_count_at_the_target() -> None:
    a = _scaler()
    for t in range(20):  # demand hovering within 10 % of 3 replicas' target
        assert a.step(float(t), {"p": 30.0 + (2.5 if t % 2 else -2.5)}, {"p": 3}) == []


def test_down_after_quiet_one_at_a_time_never_below_min() -> None:
    a = _scaler(min=2)
    cur = 5
    downs: list[float] = []
    t = 0.0
    while t < 30:
        for d in a.step(t, {"p": 0.0}, {"p": cur}):
            assert d.direction == "down" and d.desired == cur - 1
            cur = d.desired
            downs.append(t)
        t += 0.25
    assert cur == 2
    assert downs[0] >= 5.0  # the quiet period
    assert all(b - a_ >= 1.0 for a_, b in itertools.pairwise(downs))  # cool-down


def test_a_burst_during_the_quiet_period_restarts_it() -> None:
    a = _scaler()
    assert a.step(0.0, {"p": 0.0}, {"p": 3}) == []
    assert a.step(4.0, {"p": 30.0}, {"p": 3}) == []  # back at the target: quiet broken
    assert a.step(6.0, {"p": 0.0}, {"p": 3}) == []
    assert a.step(10.5, {"p": 0.0}, {"p": 3}) == []  # 4.5 s of quiet: not yet
    assert a.step(11.0, {"p": 0.0}, {"p": 3})[0].desired == 2


def test_no_flapping_under_load_that_crosses_the_threshold() -> None:
    """Demand swinging between 1.3 and 0.7 replicas' worth every second for a minute: one
    scale-up, and no scale-down (the quiet period never completes)."""
    a = _scaler(down_quiet_s=5.0)
    cur, moves = 1, []
    for i in range(240):
        t = i * 0.25
        for d in a.step(t, {"p": 13.0 if int(t) % 2 == 0 else 7.0}, {"p": cur}):
            moves.append(d.direction)
            cur = d.desired
    assert moves == ["up"]


def test_floor_spill_wake_contention_and_busy() -> None:
    primary = PoolScaling("primary", 1, 2, 10.0, floor=2, spill_to="fallback")
    fallback = PoolScaling("fallback", 0, 2, 10.0)
    a = Autoscaler([primary, fallback])
    # The controller's floor of full replicas holds primary at 2 even with no demand.
    (d,) = a.step(0.0, {}, {"primary": 1, "fallback": 0})
    assert (d.pool, d.desired) == ("primary", 2)
    # 35 streams: primary holds 20 at its max, 15 spill: the sleeping fallback wakes to 2.
    (d,) = a.step(10.0, {"primary": 35.0}, {"primary": 2, "fallback": 0})
    assert (d.pool, d.current, d.desired) == ("fallback", 0, 2)
    assert "waking" in d.reason
    # Contended: the lowered cap queues requests, which is not load: hold.
    b = Autoscaler([PoolScaling("primary", 1, 4, 10.0)])
    assert b.step(0.0, {"primary": 40.0}, {"primary": 1}, {"primary": 1}) == []
    assert b.step(0.5, {"primary": 40.0}, {"primary": 1}, {}, busy={"primary"}) == []
    assert b.step(1.0, {"primary": 40.0}, {"primary": 1})[0].desired == 4


def test_spec_ranges() -> None:
    s = parse_spec({"pools": [{"name": "a", "replicas": {"min": 0, "max": 3}}]})
    p = s.pools[0]
    assert (p.replicas, p.min_replicas, p.max_replicas) == (0, 0, 3)
    again = parse_spec(s.model_dump(mode="json"))  # what a reload's diff reads back
    assert again.pools[0].autoscale == p.autoscale
    for bad, says in (
        ({"min": 3, "max": 1}, "must not exceed"),
        ({"min": 0, "max": 0}, "greater than or equal to 1"),
        ({"min": 1, "max": 99}, "less than or equal to 64"),
    ):
        with pytest.raises(SpecError, match=says):
            parse_spec({"pools": [{"name": "a", "replicas": bad}]})


def test_parse_demand_reads_only_the_signal() -> None:
    text = (
        "# HELP unbroken_gateway_pool_demand x\n# TYPE unbroken_gateway_pool_demand gauge\n"
        'unbroken_gateway_pool_demand{pool="primary"} 12.0\n'
        'unbroken_gateway_pool_demand{pool="fallback"} 0.0\n'
        'unbroken_gateway_pool_demand_other{pool="primary"} 99.0\n'
        'unbroken_gateway_inflight{endpoint="a",pool="primary"} 7.0\n'
    )
    assert parse_demand(text) == {"primary": 12.0, "fallback": 0.0}


SPEC = f"""
model: {MODEL}
pools:
  - name: primary
    replicas: {{min: 1, max: 3}}
    scaling: {{target: 4, interval_s: 0.25, up_cooldown_s: 0.5, down_quiet_s: 3,
               down_cooldown_s: 0.5, drain_deadline_s: 1}}
    weights_size: 8MiB
    engine: {{profile: fp16, overrides: {{decode_base_s: 0.02, decode_per_seq_s: 0.0001}}}}
  - name: fallback
    replicas: {{min: 0, max: 1}}
    scaling: {{target: 4, interval_s: 0.25, up_cooldown_s: 0.5, down_quiet_s: 3,
               down_cooldown_s: 0.5, drain_deadline_s: 1}}
    weights_size: 8MiB
    engine: {{profile: fp8, overrides: {{decode_base_s: 0.02, decode_per_seq_s: 0.0001}}}}
  - name: sleepy
    model: sleepy-model
    replicas: {{min: 0, max: 1}}
    scaling: {{target: 4, interval_s: 0.25, up_cooldown_s: 0.5, down_quiet_s: 3,
               down_cooldown_s: 0.5, drain_deadline_s: 1}}
    weights_size: 8MiB
    engine: {{profile: fp16, seed: 7, overrides: {{decode_base_s: 0.02}}}}
gateway: {{routes: {{standard: [primary, fallback, sleepy]}}, default_cap: 4}}
controller:
  # Contention detection would hold scaling; on this shared machine it must not judge.
  itl_enter_ratio: 1000
  itl_exit_ratio: 999
  cuda_enter_ratio: 1000
  cuda_exit_ratio: 999
  cuda_strong_ratio: null
  convert_after_s: null
  min_full_replicas: 0
"""


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp: Path = tmp_path_factory.mktemp("autoscale")
    spec = tmp / "spec.yaml"
    spec.write_text(SPEC)
    u = Up(tmp, spec)
    yield u
    u.stop()


def _pools(u: Up) -> dict[str, Any]:
    return dict(u.status()["pools"])


def _decisions(u: Up) -> list[dict[str, Any]]:
    r = httpx.get(f"http://127.0.0.1:{u.controller_port}/decisions", timeout=10)
    return list(r.json()["decisions"])


def _stream(url: str, body: dict[str, Any], stop: threading.Event) -> tuple[int, str, bool]:
    """(status, text received, finished): reads until the stream ends or `stop` is set
    (then it closes the connection: the client leaves, as a user who stops reading)."""
    dec, texts = SSEDecoder(), []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                      timeout=120) as r:  # fmt: skip
        for chunk in r.iter_raw():
            for ev in dec.feed(chunk):
                if ev.is_done:
                    return r.status_code, "".join(texts), True
                if ev.data is not None:
                    obj = orjson.loads(ev.data)
                    texts.extend(c.get("text", "") for c in obj.get("choices", []))
            if stop.is_set():
                return r.status_code, "".join(texts), False
    return r.status_code, "".join(texts), False


def test_pipeline_grows_wakes_and_shrinks_without_a_dropped_byte(up: Up) -> None:
    """16 long streams at 4 per replica: primary grows to its max of 3 and what it cannot
    hold wakes the fallback; then 13 clients leave, and with 3 streams still running both
    pools shrink one replica at a time through drain and migration: the 3 survivors are
    byte-exact, the others a prefix of their exact text."""
    pools = _pools(up)
    assert (pools["primary"]["live"], pools["fallback"]["live"]) == (1, 0)
    assert (pools["primary"]["min"], pools["primary"]["max"]) == (1, 3)

    n, toks = 16, 1500  # ~30 s each at 20 ms a token: they outlast the scale-up
    survivors = {0, 1, 2}
    leave = threading.Event()
    results: list[tuple[int, str, bool]] = [(0, "", False)] * n

    def client(i: int) -> None:
        body = {"model": MODEL, "prompt": f"burst {i}", "max_tokens": toks, "temperature": 0}
        stop = threading.Event() if i in survivors else leave
        results[i] = _stream(up.url, body, stop)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    wait_for(
        lambda: (p := _pools(up))["primary"]["live"] == 3 and p["fallback"]["live"] == 1,
        timeout=90,
        interval=0.2,
        what=lambda: f"scale-up: {json.dumps(_pools(up))}",
    )
    leave.set()
    for i, t in enumerate(threads):
        if i not in survivors:
            t.join(60)
    # Demand 3 wants 1 primary and no fallback: after the 3 s quiet period, one at a time.
    wait_for(
        lambda: (p := _pools(up))["primary"]["live"] == 1 and p["fallback"]["live"] == 0,
        timeout=90,
        interval=0.2,
        what=lambda: f"scale-down: {json.dumps(_pools(up))}",
    )
    for i in survivors:
        threads[i].join(150)
    for i, (status, text, finished) in enumerate(results):
        want = expected_completion(f"burst {i}", toks).text
        assert status == 200, (i, status)
        if i in survivors:
            assert finished and text == want, i
        else:
            assert text and want.startswith(text), i

    decisions = [d for d in _decisions(up) if d["action"].startswith("scale")]
    ups = [d for d in decisions if d["action"].startswith("scale up to")]
    downs = [d for d in decisions if d["action"].startswith("scale down to")]
    done = [d for d in decisions if d["action"].endswith("done")]
    assert {(d["endpoint"], d["to"]) for d in ups} >= {("primary", 3), ("fallback", 1)}
    for d in ups:  # in proportion to the demand each decision saw, not one per interval
        if d["endpoint"] == "primary":
            assert d["to"] == min(3, -(-int(d["demand"]) // 4)), d
    assert [d["to"] for d in downs if d["endpoint"] == "primary"] == [2, 1]
    assert all(d["result"]["ok"] for d in done), done
    assert not [d for d in decisions if d["action"].endswith("failed")], decisions
    # The replicas drained held the survivors' streams at times: migration kept them whole.
    events = up.status()["events"]
    assert any(e["event"] == "scale_removed" for e in events)
    shown = up.run("status").stdout
    assert "autoscale primary: 1 live, 1 wanted, in [1, 3]" in shown, shown
    assert "autoscale fallback: 0 live, 0 wanted, in [0, 1]" in shown, shown


def test_scale_endpoint_refuses_outside_the_range(up: Up) -> None:
    import asyncio

    import aiohttp

    async def post(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        sock = str(up.state / "supervisor.sock")
        async with (
            aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=sock)) as s,
            s.post("http://supervisor/scale", json=body) as r,
        ):
            return r.status, await r.json()

    status, body = asyncio.run(post({"pool": "primary", "replicas": 4}))
    assert status == 400 and "1 to 3" in body["error"]["message"]
    status, body = asyncio.run(post({"pool": "nope", "replicas": 1}))
    assert status == 400 and "no pool named" in body["error"]["message"]
    status, body = asyncio.run(post({"pool": "primary", "replicas": "x"}))
    assert status == 400
    # `unbroken scale POOL N`: the same route from the command line.
    r = up.run("scale", "primary", "4")
    assert r.returncode == 1 and "pool primary may have 1 to 3 replicas, not 4" in r.stderr
    r = up.run("scale", "nope", "1")
    assert r.returncode == 1 and "no pool named 'nope'" in r.stderr, r.stderr


def test_a_model_only_a_sleeping_pool_serves_wakes_it(up: Up) -> None:
    """`sleepy` has 0 replicas: its model is listed, a request for it waits in the queue
    (not a 404) while its demand wakes the pool, is answered byte-exact, and the pool goes
    back to sleep after its quiet period."""
    assert _pools(up)["sleepy"]["live"] == 0
    models = {m["id"] for m in httpx.get(up.url + "/v1/models", timeout=10).json()["data"]}
    assert "sleepy-model" in models
    t0 = time.monotonic()
    body = {"model": "sleepy-model", "prompt": "wake up", "max_tokens": 8, "temperature": 0}
    r = httpx.post(up.url + "/v1/completions", json=body, timeout=60)
    waited = time.monotonic() - t0
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected_completion("wake up", 8, seed=7).text
    assert waited < 20, waited  # the wake: a decision, a pre-warmed start, readiness
    wakes = [d for d in _decisions(up) if d["endpoint"] == "sleepy" and "up to 1" in d["action"]]
    assert wakes and "waking" in wakes[0]["reason"]

    def card() -> dict[str, Any]:
        data = httpx.get(up.url + "/v1/models", timeout=10).json()["data"]
        return next(m for m in data if m["id"] == "sleepy-model")

    awake = card()
    assert awake["max_model_len"] > 0 and awake["root"], awake  # the engine's own card
    wait_for(lambda: _pools(up)["sleepy"]["live"] == 0, timeout=60, interval=0.2,
             what=lambda: f"sleepy back to 0: {json.dumps(_pools(up))}")  # fmt: skip
    # Asleep again, it is listed as its engine listed it (a client sizing its prompts by
    # `max_model_len` must not see the field come and go with the autoscaler).
    asleep = card()
    assert {**asleep, "created": 0} == {**awake, "created": 0}, (asleep, awake)


def test_scale_up_is_bounded_by_the_machines_memory() -> None:
    """`fits` counts each new replica at the largest resident size of the pool's live ones
    against MemAvailable: this test process stands in for a replica."""
    import os
    from types import SimpleNamespace

    from unbroken.pipeline import scale

    me = SimpleNamespace(name="p-1", pid=os.getpid(), serving=True)
    sup: Any = SimpleNamespace(replicas_of=lambda pool: [me])
    n, why = scale.fits(sup, "p", 1)
    assert (n, why) == (1, None)  # one more test process fits
    n, why = scale.fits(sup, "p", 10**6)
    assert 0 <= n < 10**6 and why is not None and "MiB available" in why
    none: Any = SimpleNamespace(replicas_of=lambda pool: [])
    assert scale.fits(none, "p", 3) == (3, None)  # nothing to size by: no limit


def test_a_conversion_holds_the_pools_it_involves() -> None:
    """Dynamic precision moves a replica from the full tier to the degraded one: the
    autoscaler must not answer the full pool's loss with a new replica (nor retire the
    converted one as idle) while the conversion holds; other pools scale as before."""
    from unbroken.config.spec import ControllerSettings
    from unbroken.controller.actions import EndpointView, Tiers
    from unbroken.controller.config import ControllerConfig
    from unbroken.controller.metrics import ControllerMetrics
    from unbroken.controller.precision_driver import PrecisionDriver

    cfg = ControllerConfig(
        settings=ControllerSettings(convert_after_s=1.0),
        admin_urls=[],
        admin_token="t",
        tiers=Tiers(("primary",), ("fallback",)),
        supervisor_socket="/nonexistent.sock",
    )
    d = PrecisionDriver(cfg, ControllerMetrics(), lambda _: None, lambda c: c.close())
    view = EndpointView("fallback-2", "fallback", "http://x", "ready", 0, 8, None, "normal")
    assert d.pools_involved({}) == set()
    d.precision.converted["fallback-2"] = "primary"
    assert d.pools_involved({"fallback-2": view}) == {"primary", "fallback"}
    d.precision.converted.clear()
    d.converting = "primary-1"
    assert d.pools_involved({}) == {"primary", "fallback"}
    a = Autoscaler([PoolScaling("primary", 1, 4, 10.0), PoolScaling("other", 1, 4, 10.0)])
    out = a.step(0.0, {"primary": 40.0, "other": 40.0}, {"primary": 1, "other": 1},
                 busy=d.pools_involved({}))  # fmt: skip
    assert [x.pool for x in out] == ["other"]


def test_the_floor_is_one_pool_per_model_and_says_so() -> None:
    """`min_full_replicas` is held by one full-precision pool per model, never by a pool
    declared `min: 0`; a resize to the pool's least says so, not "waking: demand 0"."""
    from unbroken.controller.scaling import floor_carriers

    def pool(name: str, model: str, lo: int | None, declared: int = 1) -> dict[str, Any]:
        auto = None if lo is None else {"min": lo, "max": 4}
        return {"name": name, "model": model, "declared": declared, "autoscale": auto}

    full = {"primary", "coder", "second", "fixed", "sleepy"}

    def floor(name: str) -> int:
        return 1 if name in full else 0

    pools = [
        pool("primary", "llama", 1),
        pool("fallback", "llama", 0),  # degraded: no floor
        pool("second", "llama", 1),  # the model's floor is primary's
        pool("coder", "qwen", 0),  # min 0: sleeps
        pool("fixed", "mistral", None, declared=2),
        pool("sleepy", "mistral", 1),  # mistral's floor is the fixed pool's
    ]
    assert floor_carriers(pools, floor) == {"llama": "primary", "mistral": "fixed"}
    a = Autoscaler([PoolScaling("p", 1, 4, 10.0, floor=2)])
    (d,) = a.step(0.0, {}, {"p": 0})
    assert d.desired == 2 and "demand 0 at 0" not in d.reason, d.reason
    assert d.reason == "starting: below its least of 2 replica(s) (min 1, full-precision " \
        "floor 2); demand 0", d.reason  # fmt: skip


# README.md's autoscaling example, as written there, but for a key digest of a real key and
# the local rate-limit store (no Redis here).
README_SPEC = """
model: llama-8b
pools:
  - name: primary
    replicas: {min: 1, max: 4}        # autoscaled on the gateway's demand (streams + queue)
    scaling: {target: 48}             # per replica; cool-downs, quiet period: docs/pipeline.md
    adapters: {sql: /models/adapters/sql}  # vLLM --lora-modules; replicas holding it preferred
  - name: coder
    model: qwen-coder-7b
    replicas: {min: 0, max: 2}        # sleeps until a request for qwen-coder-7b arrives
tenants:
  - name: acme
    api_keys: ["DIGEST"]              # `unbroken key-hash KEY`; the spec holds no secret
    priority: standard                # a ceiling: the priority header may only lower it
    weight: 2                         # its share of a full pool against other standard tenants
    limits: {requests_per_minute: 600, completion_tokens_per_minute: 200000, concurrent_streams: 64}
rate_limit: {store: local}
"""


def test_readme_min_0_pool_sleeps_until_its_model_is_asked_for(tmp_path: Path) -> None:
    """The README's `coder` pool (`min: 0`, fp16 like every pool there) stays at 0 replicas
    once the autoscaler runs (it was woken 2 s after the start by the controller's floor of
    full-precision replicas, "waking: demand 0 at 0 replicas", and held at 1), and a request
    for its model wakes it."""
    from unbroken.config.tenants import key_digest

    spec = tmp_path / "spec.yaml"
    # ... with an adapter on the sleeping pool: /v1/models lists it under its base while the
    # pool sleeps, as vLLM lists it once awake (it was a plain entry, with no parent).
    text = README_SPEC.replace("DIGEST", key_digest("sk-acme")).replace(
        "    replicas: {min: 0, max: 2}",
        "    adapters: {py-lora: /adapters/py}\n    replicas: {min: 0, max: 2}",
    )
    spec.write_text(text)
    u = Up(tmp_path, spec)
    try:
        ctl = f"http://127.0.0.1:{u.controller_port}"

        def autoscaling() -> bool:
            with contextlib.suppress(httpx.HTTPError):
                return bool(httpx.get(ctl + "/state", timeout=5).json().get("autoscale"))
            return False

        wait_for(autoscaling, timeout=60, interval=0.2, what="the autoscaler's first window")
        time.sleep(4)  # several scaling intervals (0.5 s) and up cool-downs (2 s)
        pools = _pools(u)
        assert (pools["primary"]["live"], pools["coder"]["live"]) == (1, 0), pools
        assert not [d for d in _decisions(u) if d["endpoint"] == "coder"], _decisions(u)
        auth = {"Authorization": "Bearer sk-acme"}
        cards = {m["id"]: m for m in httpx.get(u.url + "/v1/models", headers=auth).json()["data"]}
        assert cards["py-lora"]["parent"] == "qwen-coder-7b", cards
        assert cards["py-lora"]["root"] == "/adapters/py", cards
        assert cards["qwen-coder-7b"].get("parent") is None, cards
        ids = list(cards)
        assert ids.index("py-lora") > ids.index("qwen-coder-7b"), ids  # bases first
        r = httpx.post(
            u.url + "/v1/completions",
            json={"model": "qwen-coder-7b", "prompt": "wake", "max_tokens": 4, "temperature": 0},
            headers={"Authorization": "Bearer sk-acme"},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        wakes = [d for d in _decisions(u) if d["endpoint"] == "coder" and "up to 1" in d["action"]]
        assert wakes and wakes[0]["reason"].startswith("waking: demand 1"), wakes
    finally:
        u.stop()


HAND_SPEC = f"""
model: {MODEL}
pools:
  - name: hand
    replicas: {{min: 0, max: 3}}
    scaling: {{drain_deadline_s: 1}}
    weights_size: 8MiB
    engine: {{profile: fp16, overrides: {{decode_base_s: 0.02, decode_per_seq_s: 0.0001}}}}
controller: {{enabled: false}}
"""


def test_scale_by_hand_reaches_its_target_and_a_last_replica_keeps_its_streams(
    tmp_path: Path,
) -> None:
    """`unbroken scale` (no autoscaler here to interfere): 0 -> 3 -> 1 in one command each
    (a review found 3 -> 1 stopping at 2 and exiting 0); then 1 -> 0 while a stream runs:
    nothing else serves the model, so the drain waits for the stream to end instead of
    cutting it at the pool's 1 s drain deadline (the review's stream got `drain_deadline`
    after 10 s). Asleep, the model answers a sheddable request 503 `model_asleep` with
    `x-should-retry: false`, not "at capacity" (429, which the openai client retries)."""
    spec = tmp_path / "spec.yaml"
    spec.write_text(HAND_SPEC)
    u = Up(tmp_path, spec)
    try:
        r = u.run("scale", "hand", "3")
        assert r.returncode == 0 and "0 -> 3 replica(s)" in r.stdout, r.stdout + r.stderr
        r = u.run("scale", "hand", "1")
        assert r.returncode == 0 and "3 -> 1 replica(s)" in r.stdout, r.stdout + r.stderr
        assert len(r.stdout.split("removed ")[1].split(",")) == 2, r.stdout  # result: stdout
        assert _pools(u)["hand"]["live"] == 1
        result: list[tuple[int, str, bool]] = []
        body = {"model": MODEL, "prompt": "last one", "max_tokens": 150, "temperature": 0}
        t = threading.Thread(target=lambda: result.append(_stream(u.url, body, threading.Event())))
        t.start()
        time.sleep(1.0)  # streaming: ~3 s at 20 ms a token
        t0 = time.monotonic()
        r = u.run("scale", "hand", "0")
        t.join(60)
        assert r.returncode == 0 and "1 -> 0 replica(s)" in r.stdout, r.stdout + r.stderr
        assert result and result[0] == (200, expected_completion("last one", 150).text, True)
        assert time.monotonic() - t0 > 1.0  # it waited for the stream, past the 1 s deadline
        assert _pools(u)["hand"]["live"] == 0
        shed = httpx.post(
            u.url + "/v1/completions",
            json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
            headers={"x-unbroken-priority": "sheddable"},
            timeout=30,
        )
        assert shed.status_code == 503, shed.text
        assert shed.json()["error"]["code"] == "model_asleep"
        assert shed.headers["x-should-retry"] == "false"
    finally:
        u.stop()
