"""Prefix-heavy workloads for `unbroken bench` and the routing benchmark, and what the
engines say about them (prefix-cache hit rate, load spread).

Routing only matters when requests share prefixes that an engine may still hold in its
prefix cache; the default random prompts share none. Two generators, both deterministic
from a seed (words of the simulator's vocabulary, nothing downloaded):

- `SharedPrefix`: kubernetes-sigs/inference-perf's `shared_prefix` data generator, with its
  parameter names and meaning: `num_groups` system prompts of `system_prompt_len` tokens,
  each followed by `num_prompts_per_group` questions of `question_len` tokens, `output_len`
  tokens out; the prompts are shuffled once and requests take them in turn (cycling), via
  /v1/completions, prompt = system prompt + " " + question (as inference-perf sends them).
- `MultiTurn`: each user holds a conversation; turn k sends (over /v1/chat/completions) an
  optional shared system prompt, every earlier user message and the assistant's actual
  reply, and a new user message; after `num_turns` turns the user starts a new
  conversation. A user keeps one session id for the whole run (header and body `user`), so
  session-aware routing has something to hold on to.

A tokens here is a word (the simulator splits on single spaces), so lengths are in words.
`EngineWatch` reads each engine's /metrics before, during and after a run: vLLM's
`vllm:prefix_cache_hits_total` / `vllm:prefix_cache_queries_total` (tokens) give the
cluster's hit rate, `vllm:request_success_total` and `vllm:num_requests_running` the spread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

from unbroken.engine.textmodel import VOCAB, expected_chat, expected_completion
from unbroken.wire.metrics import FilteredReads, filtered_path

__all__ = [
    "EngineWatch",
    "MultiTurn",
    "MultiTurnGen",
    "SharedPrefix",
    "SharedPrefixGen",
    "Turn",
    "WorkloadGen",
    "WorkloadSpec",
    "describe",
    "make_generator",
    "parse_metrics",
    "spread",
]

log = logging.getLogger("unbroken.bench")

HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"
SUCCESS = "vllm:request_success_total"
RUNNING = "vllm:num_requests_running"
# vLLM's per-request phase histograms: arrival -> scheduled (WAITING) and scheduled -> first
# token (PREFILL: the step that computed the request's uncached prompt), and TTFT itself.
QUEUE = "vllm:request_queue_time_seconds"
PREFILL = "vllm:request_prefill_time_seconds"
TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"  # per step: a running request's gap is one step
PREEMPTIONS = "vllm:num_preemptions_total"


@dataclass(frozen=True)
class SharedPrefix:
    """inference-perf's `data.shared_prefix` (its defaults), lengths in words."""

    num_groups: int = 10
    num_prompts_per_group: int = 10
    system_prompt_len: int = 100
    question_len: int = 50
    output_len: int = 50
    name: str = field(default="shared-prefix", init=False)

    def __post_init__(self) -> None:
        _check(self, "num_groups", "num_prompts_per_group", "output_len")


@dataclass(frozen=True)
class MultiTurn:
    """Chat conversations of `num_turns` turns; each turn adds `question_len` words from the
    user and `output_len` from the assistant to the history the next turn carries.

    The defaults are chat's shape: replies about three times the question (LMSYS-Chat-1M's
    million real conversations average ~70 tokens a user message and ~215 a reply), so a
    turn's history is mostly earlier replies, which only the engine that generated them
    holds. (Until 2026-12-03: 5 turns, 100-word system prompt, 50-word questions and
    replies; `unbroken bench --num-turns 5 --system-prompt-len 100 --question-len 50
    --output-len 50` still sends that.)"""

    num_turns: int = 6
    system_prompt_len: int = 200  # one system prompt shared by every conversation; 0: none
    question_len: int = 70
    output_len: int = 215
    name: str = field(default="multi-turn", init=False)

    def __post_init__(self) -> None:
        _check(self, "num_turns", "question_len", "output_len")


def _check(spec: object, *positive: str) -> None:
    """Refuse a spec that would send nothing useful: these fields >= 1, lengths >= 0."""
    for name in ("system_prompt_len", "question_len", *positive):
        least = 1 if name in positive else 0
        if getattr(spec, name) < least:
            raise ValueError(f"{name} must be at least {least}, got {getattr(spec, name)}")


WorkloadSpec = SharedPrefix | MultiTurn


@dataclass(slots=True)
class Turn:
    """One request a workload wants sent, and what its text is checked against."""

    chat: bool
    max_tokens: int
    prompt: str = ""  # /v1/completions
    messages: tuple[tuple[str, str], ...] = ()  # /v1/chat/completions: (role, content)
    session: str | None = None
    turn: int = 0  # 0-based turn in its conversation (0 for single requests)
    group: int | None = None  # shared-prefix group

    def expected(self, seed: int) -> str:
        """The simulator's greedy text for this request."""
        if self.chat:
            return expected_chat(self.messages, self.max_tokens, seed=seed).text
        return expected_completion(self.prompt, self.max_tokens, seed=seed).text


class WorkloadGen(Protocol):
    def next(self, user: int) -> Turn: ...

    def done(self, user: int, turn: Turn, reply: str | None) -> None:
        """The request ended: `reply` is its text when the stream finished, else None."""


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(VOCAB) for _ in range(n))


class SharedPrefixGen:
    """inference-perf's order: all prompts built up front, shuffled once, taken in turn."""

    def __init__(self, spec: SharedPrefix, seed: int) -> None:
        rng = random.Random(f"shared-prefix:{seed}")
        self.spec = spec
        self.system_prompts = [words(rng, spec.system_prompt_len) for _ in range(spec.num_groups)]
        self.prompts: list[tuple[int, str]] = []
        for g, system in enumerate(self.system_prompts):
            for _ in range(spec.num_prompts_per_group):
                q = words(rng, spec.question_len)
                self.prompts.append((g, f"{system} {q}" if system and q else system or q))
        rng.shuffle(self.prompts)
        self._i = 0

    def next(self, user: int) -> Turn:
        g, prompt = self.prompts[self._i % len(self.prompts)]
        self._i += 1
        return Turn(chat=False, max_tokens=self.spec.output_len, prompt=prompt, group=g)

    def done(self, user: int, turn: Turn, reply: str | None) -> None:
        pass


@dataclass(slots=True)
class _Conversation:
    number: int = 0
    turn: int = 0
    history: tuple[tuple[str, str], ...] = ()


class MultiTurnGen:
    """Per user, one conversation at a time. A turn whose stream did not finish is sent again
    (same question, same history), as inference-perf keeps the last context on a failure."""

    def __init__(self, spec: MultiTurn, seed: int) -> None:
        self.spec, self.seed = spec, seed
        system = words(random.Random(f"multi-turn:{seed}:system"), spec.system_prompt_len)
        self.system: tuple[tuple[str, str], ...] = (("system", system),) if system else ()
        self.conversations: dict[int, _Conversation] = {}

    def session(self, user: int) -> str:
        return f"bench-{self.seed}-user-{user}"

    def next(self, user: int) -> Turn:
        c = self.conversations.setdefault(user, _Conversation())
        # Keyed by (user, conversation, turn), not drawn in order: the text of a turn does not
        # depend on which user happened to ask first.
        rng = random.Random(f"multi-turn:{self.seed}:{user}:{c.number}:{c.turn}")
        question = words(rng, self.spec.question_len)
        return Turn(
            chat=True,
            max_tokens=self.spec.output_len,
            messages=(*self.system, *c.history, ("user", question)),
            session=self.session(user),
            turn=c.turn,
        )

    def done(self, user: int, turn: Turn, reply: str | None) -> None:
        c = self.conversations[user]
        if reply is None or turn.turn != c.turn:
            return
        c.history = (*c.history, turn.messages[-1], ("assistant", reply))
        c.turn += 1
        if c.turn >= self.spec.num_turns:
            self.conversations[user] = _Conversation(number=c.number + 1)


def make_generator(spec: WorkloadSpec, seed: int) -> WorkloadGen:
    if isinstance(spec, SharedPrefix):
        return SharedPrefixGen(spec, seed)
    return MultiTurnGen(spec, seed)


# -- what the engines saw -------------------------------------------------------------------


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text: each sample name's value, summed over its label sets."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        if 0 <= brace < line.find(" "):  # name{labels} value: label values may hold spaces
            name, value = line[:brace], line[line.rindex("}") + 1 :].split()
        else:
            name, *value = line.split()
        try:
            out[name] = out.get(name, 0.0) + float(value[0])
        except (IndexError, ValueError):
            continue
    return out


@dataclass
class EngineWatch:
    """Counters of each engine before and after a run, and its running requests sampled in
    between: the cluster's prefix-cache hit rate and how evenly the router spread the load.

    With `discover` (the running pipeline's engines, asked every `full_every_s`), engines
    that come and go during the run (a rollout, a replaced replica) count too: a new one
    from zero (its counters start with it), a gone one up to its last full reading."""

    urls: list[str]
    every_s: float = 0.25
    discover: Callable[[], Awaitable[list[str]]] | None = None
    full_every_s: float = 2.0
    last: dict[str, dict[str, float]] = field(default_factory=dict)
    before: dict[str, dict[str, float]] = field(default_factory=dict)
    after: dict[str, dict[str, float]] = field(default_factory=dict)
    max_running: dict[str, float] = field(default_factory=dict)
    unreadable: dict[str, str] = field(default_factory=dict)
    _task: asyncio.Task[None] | None = None
    _session: aiohttp.ClientSession | None = None
    _running: FilteredReads = field(default_factory=lambda: FilteredReads(filtered_path([RUNNING])))

    async def _page(self, url: str, path: str) -> str | None:
        assert self._session is not None
        try:
            async with self._session.get(url.rstrip("/") + path) as r:
                if r.status != 200:
                    self.unreadable[url] = f"HTTP {r.status}"
                    return None
                return await r.text()
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            self.unreadable[url] = type(e).__name__
            return None

    async def _read(self, url: str, running_only: bool) -> dict[str, float] | None:
        # Mid-run only the running gauge, asked for by name: the whole page costs the
        # simulator ~6 ms of the process that runs its steps, four times a second.
        if running_only:
            text = await self._running.read(url, lambda path: self._page(url, path))
        else:
            text = await self._page(url, "/metrics")
        return None if text is None else parse_metrics(text)

    async def _read_all(self, running_only: bool = False) -> dict[str, dict[str, float]]:
        got = await asyncio.gather(*(self._read(u, running_only) for u in self.urls))
        return {u: m for u, m in zip(self.urls, got, strict=True) if m is not None}

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        self.before = await self._read_all()
        self.max_running = {u: m.get(RUNNING, 0.0) for u, m in self.before.items()}
        self._task = asyncio.create_task(self._sample())

    async def _sample(self) -> None:
        full_at = time.monotonic() + self.full_every_s
        while True:
            await asyncio.sleep(self.every_s)
            full = self.discover is not None and time.monotonic() >= full_at
            if full:
                full_at = time.monotonic() + self.full_every_s
                await self._rediscover()
            for u, m in (await self._read_all(running_only=not full)).items():
                self.max_running[u] = max(self.max_running.get(u, 0.0), m.get(RUNNING, 0.0))
                if full:
                    self.last[u] = m

    async def _rediscover(self) -> None:
        assert self.discover is not None
        try:
            now = await self.discover()
        except Exception as e:  # the pipeline's status unreadable for a moment: keep the list
            log.debug("engine discovery: %s", e)
            return
        for u in now:
            if u not in self.urls:
                self.urls.append(u)
                self.before.setdefault(u, {})  # started during the run: its counters from 0

    async def stop(self) -> dict[str, Any]:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._session is not None:
            self.after = await self._read_all()
            await self._session.close()
        for u, m in self.last.items():  # gone before the end: as last read
            if u not in self.after:
                self.after[u] = m
                self.unreadable.pop(u, None)
        return self.result()

    def result(self) -> dict[str, Any]:
        """Per engine: requests served and tokens queried/hit over the run, max running; and
        the cluster's totals. `hit_rate` is None when no engine exports the counters."""
        engines: dict[str, dict[str, Any]] = {}
        for u in self.urls:
            b, a = self.before.get(u), self.after.get(u)
            if b is None or a is None:
                engines[u] = {"error": self.unreadable.get(u, "not read")}
                continue
            cache = HITS in a and QUERIES in a
            engines[u] = {
                "requests": round(a.get(SUCCESS, 0.0) - b.get(SUCCESS, 0.0)),
                "max_running": round(self.max_running.get(u, 0.0)),
                "queries": a[QUERIES] - b.get(QUERIES, 0.0) if cache else None,
                "hits": a[HITS] - b.get(HITS, 0.0) if cache else None,
            }
        read = [e for e in engines.values() if "error" not in e]
        cached = [e for e in read if e["queries"] is not None]
        queries = sum(e["queries"] for e in cached)
        hits = sum(e["hits"] for e in cached)
        served = [e["requests"] for e in read]
        return {
            "engines": engines,
            "ttft_parts": self.ttft_parts(),
            "hit_rate": hits / queries if cached and queries else None,
            "hits": hits if cached else None,
            "queries": queries if cached else None,
            "cache_counters": bool(cached),
            "spread": spread(served),
        }

    def ttft_parts(self) -> dict[str, float] | None:
        """The engines' own account of a request's first token, means over the run (ms):
        `queue` (arrival until the scheduler took it: the rest of the step then running),
        `prefill` (scheduled until its first token: the step that computed its uncached
        prompt, with everyone else's decode and prefill in it), `ttft` (the engine's TTFT),
        `step` (the mean gap between a running request's tokens: one step); `prompt` and
        `uncached` prompt tokens per request; `preemptions` (all engines, over the run: a
        preempted request is recomputed, and waiting requests wait for the room). None when
        the engines lack the series."""
        sums = dict.fromkeys(("queue", "prefill", "ttft", "itl", "n", "ttft_n", "itl_n"), 0.0)
        sums |= {"q": 0.0, "h": 0.0, "pre": 0.0}
        names = {"queue": QUEUE, "prefill": PREFILL, "ttft": TTFT, "itl": ITL}
        for u in self.urls:
            b, a = self.before.get(u), self.after.get(u)
            if b is None or a is None or f"{PREFILL}_count" not in a:
                return None

            def d(name: str, a: dict[str, float] = a, b: dict[str, float] = b) -> float:
                return a.get(name, 0.0) - b.get(name, 0.0)

            for k, name in names.items():
                sums[k] += d(f"{name}_sum")
            sums["n"] += d(f"{PREFILL}_count")
            sums["ttft_n"] += d(f"{TTFT}_count")
            sums["itl_n"] += d(f"{ITL}_count")
            sums["q"] += d(QUERIES)
            sums["h"] += d(HITS)
            sums["pre"] += d(PREEMPTIONS)
        n, tn = sums["n"], sums["ttft_n"]
        if not n or not tn:
            return None
        return {
            "queue_ms": sums["queue"] / n * 1e3,
            "prefill_ms": sums["prefill"] / n * 1e3,
            "ttft_ms": sums["ttft"] / tn * 1e3,
            "step_ms": sums["itl"] / sums["itl_n"] * 1e3 if sums["itl_n"] else 0.0,
            "uncached": (sums["q"] - sums["h"]) / tn,
            "prompt": sums["q"] / tn,
            "preemptions": sums["pre"],
        }


def spread(served: list[int]) -> float | None:
    """Busiest over least-busy engine's requests served (inf when one served none)."""
    if len(served) < 2 or not any(served):
        return None
    return max(served) / min(served) if min(served) else float("inf")


def describe(res: dict[str, Any] | None) -> list[str]:
    """The report's lines on the engines: hit rate and spread, or why they are missing."""
    if res is None:
        return [
            "prefix-cache hit rate and load spread: not measured (give the engines' URLs "
            "with --engine-metrics)"
        ]
    lines = []
    if res["hit_rate"] is not None:
        lines.append(
            f"prefix-cache hit rate: {res['hit_rate']:.1%} ({res['hits']:.0f} of "
            f"{res['queries']:.0f} prompt tokens found in the engines' prefix caches)"
        )
    elif res["cache_counters"]:
        lines.append("prefix-cache hit rate: no prompt tokens queried during the run")
    elif res["engines"] and all("error" in e for e in res["engines"].values()):
        lines.append("prefix-cache hit rate: unknown (no engine's /metrics could be read)")
    else:
        lines.append(f"prefix-cache hit rate: unknown (no engine exports {QUERIES} / {HITS})")
    parts = []
    for u, e in res["engines"].items():
        if "error" in e:
            parts.append(f"{u}: unreadable ({e['error']})")
        else:
            rate = f", hit rate {e['hits'] / e['queries']:.0%}" if e["queries"] else ""
            parts.append(f"{u}: {e['requests']} requests, max {e['max_running']} running{rate}")
    s = res["spread"]
    ratio = (
        "n/a"
        if s is None
        else f"{s:.2f}x"
        if math.isfinite(s)
        # A fallback pool by design (unbroken's fp8 takes standard work only when fp16 is
        # busy), or an engine a router starved: a review read it as a routing fault.
        else "inf (an engine served none: a fallback pool that takes work only when the "
        "first is busy, or one the router starved)"
    )
    lines.append(f"load spread (busiest/least-busy requests served): {ratio}; " + "; ".join(parts))
    return lines
