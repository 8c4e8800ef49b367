"""Prefix-heavy workloads of `unbroken bench` (bench/workloads.py): the generators are
deterministic and have the shape asked for, and short real runs against one simulator
verify every text, carry the real replies in the history and send the session id."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from helpers import Proc, engine
from unbroken.bench.load import LoadConfig, LoadRun
from unbroken.bench.report import results_json
from unbroken.bench.workloads import (
    EngineWatch,
    MultiTurn,
    MultiTurnGen,
    SharedPrefix,
    SharedPrefixGen,
    describe,
    parse_metrics,
    spread,
)
from unbroken.engine.textmodel import VOCAB, expected_chat
from unbroken.wire.http import free_port


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Proc:
    e = engine(tmp_path_factory.mktemp("workloads"))
    yield e
    e.stop()


def test_shared_prefix_has_inference_perfs_shape_and_is_deterministic() -> None:
    spec = SharedPrefix(
        num_groups=4, num_prompts_per_group=5, system_prompt_len=40, question_len=7, output_len=9
    )
    gen = SharedPrefixGen(spec, seed=3)
    assert [p for _, p in gen.prompts] == [p for _, p in SharedPrefixGen(spec, 3).prompts]
    assert gen.prompts != SharedPrefixGen(spec, 4).prompts
    assert len(gen.prompts) == 20 and len(set(gen.system_prompts)) == 4
    for g, prompt in gen.prompts:
        system = gen.system_prompts[g]
        assert len(system.split()) == 40 and prompt.startswith(system + " ")
        assert len(prompt.split()) == 47 and set(prompt.split()) <= set(VOCAB)
    # Shuffled once (not group after group), then taken in turn and cycled.
    assert len({g for g, _ in gen.prompts[:5]}) > 1
    turns = [gen.next(user=i % 3) for i in range(25)]
    assert [t.prompt for t in turns[:20]] == [p for _, p in gen.prompts]
    assert [t.prompt for t in turns[20:]] == [p for _, p in gen.prompts[:5]]
    assert all(not t.chat and t.max_tokens == 9 and t.session is None for t in turns)


def test_multi_turn_history_grows_with_the_real_replies() -> None:
    spec = MultiTurn(num_turns=3, system_prompt_len=12, question_len=5, output_len=4)
    gen = MultiTurnGen(spec, seed=7)
    t0 = gen.next(0)
    assert t0.chat and t0.turn == 0 and t0.session == gen.session(0)
    assert [r for r, _ in t0.messages] == ["system", "user"]
    assert len(t0.messages[0][1].split()) == 12 and len(t0.messages[1][1].split()) == 5
    # A turn that did not finish is sent again, unchanged.
    gen.done(0, t0, None)
    assert gen.next(0) == t0
    gen.done(0, t0, "reply zero")
    t1 = gen.next(0)
    assert t1.turn == 1 and t1.session == t0.session
    assert t1.messages[:2] == t0.messages
    assert t1.messages[2] == ("assistant", "reply zero") and t1.messages[3][0] == "user"
    gen.done(0, t1, "reply one")
    t2 = gen.next(0)
    assert [c for _, c in t2.messages[:5]] == [c for _, c in t1.messages] + ["reply one"]
    assert len(t2.messages) == 6 and t2.turn == 2
    # After num_turns, a new conversation: same user, same session, history reset.
    gen.done(0, t2, "reply two")
    t3 = gen.next(0)
    assert t3.turn == 0 and t3.session == t0.session and len(t3.messages) == 2
    assert t3.messages[1] != t0.messages[1] and t3.messages[0] == t0.messages[0]
    # A user's text does not depend on the order other users asked in.
    other = MultiTurnGen(spec, seed=7)
    other.next(5)
    assert other.next(0) == t0 and MultiTurnGen(spec, seed=8).next(0) != t0
    assert MultiTurnGen(MultiTurn(system_prompt_len=0), 1).next(0).messages[0][0] == "user"
    with pytest.raises(ValueError, match="num_turns"):
        MultiTurn(num_turns=0)


def test_metrics_parsing_and_the_spread() -> None:
    text = (
        "# TYPE vllm:prefix_cache_hits_total counter\n"
        'vllm:prefix_cache_hits_total{engine="0",model_name="a b"} 30.0\n'
        'vllm:request_success_total{finished_reason="length"} 4\n'
        'vllm:request_success_total{finished_reason="stop"} 2\n'
        "process_open_fds 16.0\n"
    )
    m = parse_metrics(text)
    assert m["vllm:prefix_cache_hits_total"] == 30 and m["vllm:request_success_total"] == 6
    assert m["process_open_fds"] == 16
    assert spread([10, 5, 8]) == 2.0 and spread([3, 0]) == float("inf") and spread([4]) is None
    w = EngineWatch(["http://a", "http://b"])
    c = {"vllm:prefix_cache_queries_total": 0.0, "vllm:prefix_cache_hits_total": 0.0}
    w.before = {"http://a": {**c}, "http://b": {**c}}
    w.after = {
        "http://a": {"vllm:prefix_cache_queries_total": 100.0, "vllm:prefix_cache_hits_total": 75.0,
                     "vllm:request_success_total": 6.0},
        "http://b": {"vllm:prefix_cache_queries_total": 100.0, "vllm:prefix_cache_hits_total": 25.0,
                     "vllm:request_success_total": 3.0},
    }  # fmt: skip
    res = w.result()
    assert res["hit_rate"] == 0.5 and res["spread"] == 2.0
    assert "50.0%" in describe(res)[0] and "2.00x" in describe(res)[1]
    assert "not measured" in describe(None)[0]
    # An engine that served nothing: said in words, and results.json stays strict JSON
    # (Python's json writes `Infinity`, which jq and JavaScript refuse).
    w.after["http://b"]["vllm:request_success_total"] = 0.0
    idle = w.result()
    assert "inf (an engine served none: a fallback pool" in describe(idle)[1]
    text = results_json({"engines": idle, "nan": float("nan"), "rows": [(1.5, float("-inf"))]})
    back = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON {c}"))
    assert back["engines"]["spread"] is None and back["nan"] is None
    assert back["rows"] == [[1.5, None]] and back["engines"]["hit_rate"] == 0.5
    # Every engine unreadable (a wrong URL): said so, not "no engine exports" the counters.
    gone = {"hit_rate": None, "cache_counters": False, "spread": None,
            "engines": {"http://a": {"error": "HTTP 404"}}}  # fmt: skip
    assert (
        describe(gone)[0] == "prefix-cache hit rate: unknown (no engine's /metrics could be read)"
    )


def _run(
    url: str, spec: SharedPrefix | MultiTurn, users: int = 4, duration: float = 2.0
) -> LoadRun:
    cfg = LoadConfig(url=url, users=users, spawn_rate=0, duration=duration, workload=spec)
    run = LoadRun(cfg)
    asyncio.run(run.run())
    return run


def test_shared_prefix_run_against_a_simulator(sim: Proc) -> None:
    spec = SharedPrefix(
        num_groups=2, num_prompts_per_group=4, system_prompt_len=64, question_len=8, output_len=6
    )

    async def go() -> tuple[LoadRun, dict[str, Any]]:
        watch = EngineWatch([sim.url], every_s=0.1)
        await watch.start()
        run = LoadRun(LoadConfig(url=sim.url, users=4, spawn_rate=0, duration=1.5, workload=spec))
        await run.run()
        return run, await watch.stop()

    run, res = asyncio.run(go())
    assert run.verify_mode == "sim" and len(run.records) > 8
    assert {r.outcome for r in run.records} == {"ok"}
    assert all(r.kind == "completion" and r.tokens == 6 for r in run.records)
    eng = res["engines"][sim.url]
    assert eng["requests"] == len(run.records) and 1 <= eng["max_running"] <= 4
    if res["cache_counters"]:  # the simulator's prefix cache: every prompt repeats
        assert res["hit_rate"] > 0.5


def test_engines_that_come_and_go_during_a_run_are_counted(tmp_path: Path) -> None:
    """A scenario replaces engines (a rollout): with `discover`, an engine killed mid-run
    counts up to its last full reading instead of "unreadable", and one that appears
    mid-run counts from zero (a new user's review: `unbroken bench --scenario rollout`
    reported every old engine unreadable and no prompt tokens queried)."""
    old, stay = engine(tmp_path, name="old"), engine(tmp_path, name="stay")
    new: list[Proc] = []
    live = [old.url, stay.url]
    body = {"model": "unbroken-sim", "prompt": "counted " * 40, "max_tokens": 2}

    async def go() -> dict[str, Any]:
        async def engines() -> list[str]:
            return list(live)

        watch = EngineWatch(list(live), every_s=0.05, discover=engines, full_every_s=0.2)
        await watch.start()
        async with aiohttp.ClientSession() as c:

            async def send(url: str, n: int) -> None:
                for _ in range(n):
                    async with c.post(url + "/v1/completions", json=body) as r:
                        assert r.status == 200, await r.text()

            await send(old.url, 3)
            await send(stay.url, 2)
            await asyncio.sleep(0.6)  # a full reading of `old` after its requests
            old.signal(9)
            live.remove(old.url)
            new.append(await asyncio.to_thread(engine, tmp_path, name="new"))
            live.append(new[0].url)
            await asyncio.sleep(0.6)  # discovered
            await send(new[0].url, 4)
        return await watch.stop()

    try:
        res = asyncio.run(go())
    finally:
        for p in (old, stay, *new):
            p.stop()
    eng = res["engines"]
    assert eng[old.url]["requests"] == 3, eng
    assert eng[stay.url]["requests"] == 2, eng
    assert eng[new[0].url]["requests"] == 4, eng
    if res["cache_counters"]:
        assert res["queries"] > 0


def test_multi_turn_run_sends_history_and_session(sim: Proc) -> None:
    """Through a recording proxy: each turn carries the earlier turns with the replies the
    engine gave, and the session id in the header and the body's `user`."""
    seen: list[tuple[dict[str, Any], str | None]] = []

    async def go() -> LoadRun:
        async with aiohttp.ClientSession() as client:

            async def relay(request: web.Request) -> web.StreamResponse:
                body = await request.read()
                seen.append((json.loads(body), request.headers.get("x-user-id")))
                async with client.request(
                    request.method, sim.url + request.path, data=body or None
                ) as up:
                    resp = web.StreamResponse(status=up.status)
                    resp.content_type = up.content_type
                    await resp.prepare(request)
                    async for chunk in up.content.iter_any():
                        await resp.write(chunk)
                    await resp.write_eof()
                    return resp

            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", relay)
            runner = web.AppRunner(app)
            await runner.setup()
            port = free_port()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            try:
                spec = MultiTurn(num_turns=3, system_prompt_len=20, question_len=6, output_len=5)
                cfg = LoadConfig(
                    url=f"http://127.0.0.1:{port}/v1",
                    users=3,
                    spawn_rate=0,
                    duration=1.5,
                    workload=spec,
                    session_header="x-user-id",  # a production-stack router's --session-key
                )
                run = LoadRun(cfg)
                await run.run()
                return run
            finally:
                await runner.cleanup()

    run = asyncio.run(go())
    assert {r.outcome for r in run.records} == {"ok"} and len(run.records) >= 9
    assert {r.turn for r in run.records} == {0, 1, 2}
    posts = [(b, h) for b, h in seen if "messages" in b]
    assert len(posts) == len(run.records)
    for body, header in posts:
        assert header == body["user"] and re.fullmatch(r"bench-1-user-[0-2]", header)
        msgs = [(m["role"], m["content"]) for m in body["messages"]]
        # Every assistant turn in the history is the reply the simulator gave to what came
        # before it.
        for i, (role, content) in enumerate(msgs):
            if role == "assistant":
                assert content == expected_chat(msgs[:i], 5).text
        assert len(msgs) in (2, 4, 6) and msgs[0][0] == "system"
    by_session = {h for _, h in posts}
    assert len(by_session) == 3


def test_ttft_parts_are_the_engines_own_account(sim: Proc) -> None:
    """EngineWatch's TTFT parts, from vLLM's per-request phase histograms: the wait for the
    step and the prefill step add up to the engine's TTFT, and the uncached tokens are the
    prompt tokens the prefix cache did not hold. With a shared system prompt, later turns
    prefill less than they carry."""
    spec = MultiTurn(num_turns=3, system_prompt_len=64, question_len=6, output_len=40)

    async def go() -> dict[str, Any]:
        watch = EngineWatch([sim.url])
        await watch.start()
        cfg = LoadConfig(url=sim.url, users=3, spawn_rate=0, duration=2.0, workload=spec)
        await LoadRun(cfg).run()
        return await watch.stop()

    res = asyncio.run(go())
    parts = res["ttft_parts"]
    assert parts is not None, res
    assert abs(parts["queue_ms"] + parts["prefill_ms"] - parts["ttft_ms"]) < 0.1 * parts["ttft_ms"]
    assert parts["step_ms"] > 0 and 0 < parts["uncached"] < parts["prompt"]
    n = parts["prompt"] - parts["uncached"]  # hit tokens per request
    assert n == pytest.approx(res["hits"] / (res["queries"] / parts["prompt"]))
    w = EngineWatch(["http://a"])
    w.before = w.after = {"http://a": {"vllm:prefix_cache_queries_total": 1.0}}
    assert w.ttft_parts() is None  # an engine without the histograms: no parts


def test_bench_cli_workloads(sim: Proc, tmp_path: Path) -> None:
    def bench(*args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "unbroken", "bench", "--url", sim.url, "--users", "3"]
        argv += ["--duration", "1.5", "--spawn-rate", "0", "--out", str(tmp_path), *args]
        return subprocess.run(argv, capture_output=True, text=True, timeout=60)

    # The engine's /metrics page given for its URL reads as the engine (it read 404).
    metrics_page = sim.url + "/metrics"
    r = bench("--workload", "multi-turn", "--output-len", "6", "--engine-metrics", metrics_page,
              "--session-header", "x-user-id")  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "load spread (busiest/least-busy requests served)" in r.stderr
    assert "prefix-cache hit rate" in r.stderr
    raw = json.loads((tmp_path / "results.json").read_text())
    assert raw["engines"]["engines"][sim.url]["requests"] > 0
    # multi-turn's own defaults (chat's shape), not shared-prefix's lengths
    assert "num_turns=6" in raw["meta"]["workload"]
    assert "question_len=70" in raw["meta"]["workload"]
    assert "output_len=6" in raw["meta"]["workload"]
    # The run's settings: a production-stack router's session header; not the random
    # prompts' settings, which a workload does not use.
    assert raw["config"]["session_header"] == "x-user-id"
    assert "prompt_words" not in raw["config"] and "chat_fraction" not in raw["config"]
    # inference-perf's spelling of the workload
    r = bench("--workload", "shared_prefix", "--num-groups", "2", "--output-len", "4")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "not measured (give the engines' URLs with --engine-metrics)" in r.stderr
    assert "output_len=4" in json.loads((tmp_path / "results.json").read_text())["meta"]["workload"]
    assert bench("--workload", "sharegpt").returncode == 2
    # A workload's option with the random prompts was ignored without a word.
    r = bench("--num-groups", "3")
    assert r.returncode == 2 and "--num-groups: options of --workload shared-prefix" in r.stderr
    assert bench("--workload", "shared-prefix", "--num-turns", "3").returncode == 2
    assert bench("--workload", "multi-turn", "--num-turns", "0").returncode == 2


def test_bench_cli_stops_at_duration_and_refuses_nonsense(sim: Proc, tmp_path: Path) -> None:
    """--duration holds while users are still being started (50 users at 10 a second took
    5 s to start, every one sending), and numbers out of range are refused (exit 2)."""

    def bench(*args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "unbroken", "bench", "--url", sim.url, "--out"]
        argv += [str(tmp_path), "--max-tokens", "4", *args]
        return subprocess.run(argv, capture_output=True, text=True, timeout=60)

    r = bench("--users", "50", "--spawn-rate", "10", "--duration", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    records = json.loads((tmp_path / "results.json").read_text())["records"]
    assert records and max(x["start"] for x in records) < 1.2
    assert len({x["user"] for x in records}) <= 15  # ~10 users started, not 50
    for bad, said in (
        (("--users", "0"), "--users"),
        (("--duration", "0"), "--duration"),
        (("--duration", "-3"), "--duration"),
        (("--chat-fraction", "2"), "--chat-fraction"),
        (("--slow-fraction", "-0.1"), "--slow-fraction"),
        (("--priority-mix", "foo=1"), "unknown priority 'foo'"),
        (("--priority-mix", "standard=0"), "add up to 0"),
        (("--spawn-rate", "-1"), "--spawn-rate"),
    ):
        r = bench(*bad)
        assert r.returncode == 2 and said in r.stderr, (bad, r.stderr)
    r = bench("--users", "1", "--duration", "0.5", "--model", "no-such-model")
    assert r.returncode == 1 and "--model no-such-model is not served there" in r.stderr, r.stderr
