"""An asyncio load generator for any OpenAI-compatible URL.

Closed loop: each user sends a streaming request, reads it to the end (slowly, for the
slow-reader fraction), and sends the next, until the run stops. Every request is recorded:
start, TTFT, every inter-token gap, end, tokens, outcome. Outcomes:

- ok: its finish, then [DONE], and (when verifying) the exact text;
- dropped: it ended without its finish (reset, truncated, error event);
- corrupted: it finished, but the text differs from the reference: the simulator's own
  output (when the target serves the simulator), or the same greedy request made without
  disruption straight to `reference_url` (any engine, e.g. one vLLM replica). Against an
  engine that is not the simulator and no reference, verification is off, and the run says
  so (`verification` in its events);
- rejected: 429/503 (shed, queue timeout, no capacity);
- error: any other HTTP status, or no response at all (refused, reset before the headers).

Tokens are counted as the engine counts them: every stream asks for
`stream_options.continuous_usage_stats` and takes `usage.completion_tokens` (one SSE event
can carry several tokens, or none for a partial UTF-8 character); events are counted only
where an engine sends no usage. TPOT and the inter-token gaps follow those counts.

A user backs off after an error (exponentially, 0.1 s to 5 s) and after a rejection
(Retry-After when given), so a wrong URL costs a few requests, not a flood.

Open loop (`LoadConfig.rate`): requests arrive at `rate` a second, whatever the server
does with them (Poisson arrivals, or evenly spaced), as `vllm bench serve --request-rate`,
inference-perf and guidellm load a server: a closed loop slows its own arrivals when the
server slows (a user waits for its answer before asking again), which hides the queueing a
slow server makes. `max_concurrency` caps the requests open at once (vllm bench serve's
`--max-concurrency`): an arrival past the cap waits in the client, and that wait is
recorded (`Record.wait`) and reported, not hidden. Rejections and errors are recorded and
the arrivals go on (no back-off). A multi-turn workload's conversation takes its next turn
at the first arrival after its last answer; a new conversation starts when none is idle.
Arrivals still waiting for a slot when the run stops are not sent (`LoadRun.unsent`).

`LoadConfig.workload` replaces the random prompts with a prefix-heavy workload
(`bench/workloads.py`: shared system prompts, multi-turn conversations with a session id);
its texts are verified the same way, against the messages actually sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import heapq
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import orjson

from unbroken.bench.workloads import Turn, WorkloadGen, WorkloadSpec, make_generator
from unbroken.engine.textmodel import VOCAB
from unbroken.wire.heap import freeze_startup_heap
from unbroken.wire.sse import SSEDecoder

__all__ = ["LoadConfig", "LoadRun", "Record", "base_url", "error_key"]

BACKOFF_MIN_S, BACKOFF_MAX_S = 0.1, 5.0


def base_url(url: str) -> str:
    """The server root from any form a user gives: `http://h:p`, `http://h:p/` or the
    OpenAI SDK's base URL `http://h:p/v1` (requests go to `/v1/...` below it)."""
    url = url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    return url


def error_key(r: Record) -> str:
    """How an error is counted in the error column: its status, or the exception name."""
    if r.status:
        return f"HTTP {r.status}"
    return (r.detail or "no response").split(":", 1)[0]


@dataclass
class LoadConfig:
    url: str
    model: str = "unbroken-sim"
    users: int = 50
    spawn_rate: float = 10.0  # users started per second
    duration: float = 60.0
    prompt_words: tuple[int, int] = (16, 64)
    max_tokens: tuple[int, int] = (32, 128)
    chat_fraction: float = 0.5
    priorities: dict[str, float] = field(default_factory=lambda: {"standard": 1.0})
    priority_header: str = "x-unbroken-priority"
    slow_fraction: float = 0.0
    slow_delay_s: float = 0.05  # pause after each read by a slow reader
    verify: bool = True
    reference_url: str | None = None  # verify against this engine's own greedy answers
    sim_seed: int = 0
    seed: int = 1
    api_key: str | None = None
    request_timeout_s: float = 300.0
    workload: WorkloadSpec | None = None  # None: random prompts (prompt_words, chat_fraction)
    session_header: str = "x-session-id"  # a workload's session id; also the body's `user`
    # Open loop (module doc): requests per second; None: the closed loop of `users`.
    rate: float | None = None
    # A sweep (`--rate 2,4,8`): these rates one after another, `duration / len(sweep)`
    # seconds each; `rate` is the first. Empty: `rate` for the whole run.
    sweep: tuple[float, ...] = ()
    arrival: str = "poisson"  # "poisson" or "constant" (evenly spaced)
    max_concurrency: int | None = None  # with `rate`: requests open at once (None: no cap)

    @property
    def phase_s(self) -> float:
        """A sweep's share of the run per rate (the whole run without a sweep)."""
        return self.duration / max(1, len(self.sweep))


@dataclass(slots=True)
class Record:
    user: int
    kind: str  # "chat" or "completion"
    priority: str
    slow: bool
    start: float  # seconds since the run's t0
    max_tokens: int
    status: int = 0
    ttft: float | None = None
    end: float | None = None
    tokens: int = 0
    gaps: list[float] = field(default_factory=list)
    outcome: str = "pending"
    detail: str | None = None
    endpoint: str | None = None
    profile: str | None = None  # the simulator's X-Unbroken-Profile (fp16, fp8) where it passes
    session: str | None = None
    turn: int = 0  # its turn in a multi-turn conversation
    # Open loop: seconds from its arrival to its send (waiting in the client for a slot
    # under `max_concurrency`); `start` is the send, as TTFT is measured from it.
    wait: float = 0.0

    @property
    def e2e(self) -> float | None:
        return None if self.end is None else self.end - self.start

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.end is None or self.tokens < 2:
            return None
        return (self.end - self.start - self.ttft) / (self.tokens - 1)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["e2e"], d["tpot"] = self.e2e, self.tpot
        return d


class LoadRun:
    def __init__(self, cfg: LoadConfig) -> None:
        self.cfg = cfg
        self.base = base_url(cfg.url)
        self.records: list[Record] = []
        self.events: list[dict[str, Any]] = []
        self.t0 = 0.0
        self.active = 0
        self._stop = asyncio.Event()
        self.outcomes: Counter[str] = Counter()
        self._rng = random.Random(cfg.seed)
        self.verify_mode = "sim"  # sim, reference or off; decided when the run starts
        self.verify_note = ""
        self._refs: dict[bytes, asyncio.Future[str | None]] = {}
        self.workload: WorkloadGen | None = (
            make_generator(cfg.workload, cfg.seed) if cfg.workload is not None else None
        )
        self.unsent = 0  # open loop: arrivals still waiting for a slot when the run stopped
        self.max_active = 0

    def now(self) -> float:
        return time.monotonic() - self.t0

    def mark(self, event: str, **data: Any) -> None:
        """Timestamp an event (rollout started, replica killed...) into the results."""
        self.events.append({"t": round(self.now(), 3), "event": event, **data})

    def status(self) -> str:
        """One line for a progress display: open streams and outcomes so far."""
        counts = {"ok": 0, **self.outcomes}
        return f"active {self.active}  " + "  ".join(f"{k} {v}" for k, v in counts.items())

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> list[Record]:
        freeze_startup_heap()
        freezer = asyncio.create_task(self._freeze_records())
        try:
            return await self._run()
        finally:
            freezer.cancel()
            gc.unfreeze()  # collectable again once the run is over (a test's process)

    @staticmethod
    async def _freeze_records(every_s: float = 1.0) -> None:
        """The records pile up for the whole run (a list of gaps each), so each full
        collection of this process takes longer than the last (93-97 ms by the end of a demo
        pass): a pause of the clock every latency here is measured with. Freezing every
        second keeps them out of later collections; a run is bounded, so the cyclic garbage
        frozen along with them is too (and `run` unfreezes it all at the end)."""
        while True:
            await asyncio.sleep(every_s)
            gc.freeze()

    async def _run(self) -> list[Record]:
        cfg = self.cfg
        self.t0 = time.monotonic()
        conn = aiohttp.TCPConnector(limit=0, force_close=False)
        timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s, sock_connect=10)
        async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
            await self._decide_verify(session)
            # The deadline runs while users are still being started: with a low spawn rate
            # or a short run, starting them all would outlast --duration.
            deadline = asyncio.get_running_loop().call_later(
                max(0.0, cfg.duration - self.now()), self._stop.set
            )
            try:
                if cfg.rate is not None:
                    tasks = await self._arrivals(session, cfg.rate)
                else:
                    tasks = await self._start_users(session)
                    await self._stop.wait()
            finally:
                deadline.cancel()
            self._stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
        return self.records

    async def _arrivals(
        self, session: aiohttp.ClientSession, rate: float
    ) -> list[asyncio.Task[None]]:
        """Open loop: start a request at each arrival until the run stops; the requests
        still open then."""
        cfg = self.cfg
        rng = random.Random(f"arrivals:{cfg.seed}")  # its own draws: prompts stay as seeded
        slots = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        open_: set[asyncio.Task[None]] = set()
        idle: list[int] = []  # conversations whose last turn has ended (lowest first)
        fresh = 0  # the next new conversation
        at = t0 = self.now()
        rates = cfg.sweep or (rate,)
        phase_s = cfg.phase_s
        phase = 0
        self.events.append({"t": round(at, 3), "event": "rate", "rate": rates[0]})
        while not self._stop.is_set():
            rate = rates[phase]
            nxt = at + (rng.expovariate(rate) if cfg.arrival == "poisson" else 1.0 / rate)
            if phase + 1 < len(rates) and nxt > t0 + (phase + 1) * phase_s:
                # The next rate starts at its boundary, not after a gap drawn at this one
                # (Poisson arrivals are memoryless: drawing again from there is exact).
                phase += 1
                at = t0 + phase * phase_s
                self.events.append({"t": round(at, 3), "event": "rate", "rate": rates[phase]})
                continue
            at = nxt
            delay = at - self.now()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), delay)
            if self._stop.is_set():
                break
            if idle:
                user = heapq.heappop(idle)
            else:
                user, fresh = fresh, fresh + 1
            slow = rng.random() < cfg.slow_fraction
            task = asyncio.create_task(self._arrival(session, user, slow, at, slots, idle))
            open_.add(task)
            task.add_done_callback(open_.discard)
        return list(open_)

    async def _arrival(
        self,
        session: aiohttp.ClientSession,
        user: int,
        slow: bool,
        arrived: float,
        slots: asyncio.Semaphore | None,
        idle: list[int],
    ) -> None:
        try:
            if slots is not None:
                await slots.acquire()
            try:
                if self._stop.is_set():
                    self.unsent += 1
                    return
                await self._one(session, user, slow, wait=self.now() - arrived)
            finally:
                if slots is not None:
                    slots.release()
        finally:
            heapq.heappush(idle, user)

    async def _start_users(self, session: aiohttp.ClientSession) -> list[asyncio.Task[None]]:
        """Start the users, `spawn_rate` per second (all at once when 0)."""
        tasks = []
        for i in range(self.cfg.users):
            tasks.append(asyncio.create_task(self._user(session, i)))
            if self.cfg.spawn_rate > 0:
                try:
                    await asyncio.wait_for(self._stop.wait(), 1.0 / self.cfg.spawn_rate)
                    break
                except TimeoutError:
                    pass
        return tasks

    async def _decide_verify(self, session: aiohttp.ClientSession) -> None:
        cfg = self.cfg
        if not cfg.verify:
            self.verify_mode, self.verify_note = "off", "verification turned off"
            return
        if cfg.reference_url:
            self.verify_mode = "reference"
            self.verify_note = (
                f"texts compared with the same greedy request sent to {cfg.reference_url}"
            )
            return
        owner = None
        try:
            async with session.get(self.base + "/v1/models", headers=self._auth()) as r:
                data = (await r.json(content_type=None)).get("data", [])
            owner = next((m.get("owned_by") for m in data if m.get("id") == cfg.model), None)
        except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError):
            owner = None
        if owner in (None, "unbroken"):
            self.verify_mode = "sim"
            self.verify_note = "texts compared with the simulator's expected output"
        else:
            self.verify_mode = "off"
            self.verify_note = (
                f"verification off: {cfg.model} is served by {owner!r}, not the simulator, and "
                "no reference engine was given (--reference-url)"
            )

    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.cfg.api_key}"} if self.cfg.api_key else {}

    async def _reference(
        self, session: aiohttp.ClientSession, path: str, body: dict[str, Any]
    ) -> str | None:
        """The reference engine's answer to the same greedy request, once per request."""
        ref = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        key = path.encode() + orjson.dumps(ref, option=orjson.OPT_SORT_KEYS)
        fut = self._refs.get(key)
        if fut is None:
            fut = self._refs[key] = asyncio.get_running_loop().create_future()
            text: str | None = None
            try:
                assert self.cfg.reference_url is not None
                async with session.post(
                    base_url(self.cfg.reference_url) + path,
                    data=orjson.dumps(ref),
                    headers={"Content-Type": "application/json", **self._auth()},
                ) as r:
                    if r.status == 200:
                        c = (await r.json(content_type=None))["choices"][0]
                        text = c["message"]["content"] if "message" in c else c["text"]
            except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, IndexError):
                text = None
            fut.set_result(text)
        return await fut

    def _prompt(self) -> str:
        lo, hi = self.cfg.prompt_words
        n = self._rng.randint(lo, hi)
        return " ".join(self._rng.choice(VOCAB) for _ in range(n)).capitalize()

    def _next_turn(self, user: int) -> Turn:
        """The workload's next request for this user, or a random one (the draws in the
        order they always were: chat, prompt, max_tokens)."""
        if self.workload is not None:
            return self.workload.next(user)
        chat = self._rng.random() < self.cfg.chat_fraction
        prompt = self._prompt()
        max_tokens = self._rng.randint(*self.cfg.max_tokens)
        if chat:
            return Turn(chat=True, max_tokens=max_tokens, messages=(("user", prompt),))
        return Turn(chat=False, max_tokens=max_tokens, prompt=prompt)

    def _priority(self) -> str:
        r = self._rng.random() * sum(self.cfg.priorities.values())
        for name, w in self.cfg.priorities.items():
            r -= w
            if r <= 0:
                return name
        return next(iter(self.cfg.priorities))

    async def _user(self, session: aiohttp.ClientSession, user: int) -> None:
        slow = self._rng.random() < self.cfg.slow_fraction
        failures = 0
        while not self._stop.is_set():
            rec, retry_after = await self._one(session, user, slow)
            if rec.outcome == "error":
                failures += 1
                pause = min(BACKOFF_MAX_S, BACKOFF_MIN_S * 2 ** (failures - 1))
                pause *= 0.5 + self._rng.random()  # jitter: users do not retry in lockstep
            elif rec.outcome == "rejected":
                failures = 0
                pause = retry_after if retry_after is not None else 0.5
            else:
                failures = 0
                continue
            try:
                await asyncio.wait_for(self._stop.wait(), min(pause, BACKOFF_MAX_S))
            except TimeoutError:
                pass

    async def _one(
        self, session: aiohttp.ClientSession, user: int, slow: bool, wait: float = 0.0
    ) -> tuple[Record, float | None]:
        cfg = self.cfg
        turn = self._next_turn(user)
        chat, max_tokens = turn.chat, turn.max_tokens
        priority = self._priority()
        rec = Record(
            user=user,
            kind="chat" if chat else "completion",
            priority=priority,
            slow=slow,
            start=self.now(),
            max_tokens=max_tokens,
            session=turn.session,
            turn=turn.turn,
            wait=wait,
        )
        body: dict[str, Any] = {
            "model": cfg.model,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            # Usage on every chunk: tokens counted as the engine counts them.
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        if chat:
            body["messages"] = [{"role": r, "content": c} for r, c in turn.messages]
            path = "/v1/chat/completions"
        else:
            body["prompt"] = turn.prompt
            path = "/v1/completions"
        headers = {"Content-Type": "application/json", cfg.priority_header: priority}
        if turn.session is not None:
            body["user"] = turn.session
            headers[cfg.session_header] = turn.session
        if cfg.api_key:
            headers["Authorization"] = f"Bearer {cfg.api_key}"
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        t0 = time.monotonic()
        texts: list[str] = []
        finish = None
        done = error = False
        retry_after: float | None = None
        try:
            async with session.post(
                self.base + path, data=orjson.dumps(body), headers=headers
            ) as r:
                rec.status = r.status
                rec.endpoint = r.headers.get("X-Unbroken-Endpoint")
                rec.profile = r.headers.get("X-Unbroken-Profile")
                if r.status != 200:
                    rec.outcome = "rejected" if r.status in (429, 503) else "error"
                    rec.detail = f"HTTP {r.status}"
                    with contextlib.suppress(ValueError, KeyError, AttributeError, TypeError):
                        err = orjson.loads(await r.read())["error"]
                        rec.detail += f": {err.get('code') or ''} {err.get('message')}"[:200]
                    try:
                        retry_after = float(r.headers.get("Retry-After", ""))
                    except ValueError:
                        retry_after = None
                    return rec, retry_after
                dec = SSEDecoder()
                last = None
                counted = False  # the engine reports usage: events are not tokens
                async for chunk in r.content.iter_any():
                    now = time.monotonic()
                    for ev in dec.feed(chunk):
                        if ev.data is None:
                            continue
                        if ev.is_done:
                            done = True
                            continue
                        obj = orjson.loads(ev.data)
                        if "error" in obj:
                            error = True
                            rec.detail = str(obj["error"].get("message"))[:200]
                            continue
                        pieces = 0
                        for ch in obj.get("choices") or ():
                            piece = (
                                (ch.get("delta") or {}).get("content") if chat else ch.get("text")
                            )
                            if piece:
                                texts.append(piece)
                                pieces += 1
                            if ch.get("finish_reason"):
                                finish = ch["finish_reason"]
                        u = obj.get("usage")
                        if isinstance(u, dict) and isinstance(u.get("completion_tokens"), int):
                            counted = True
                            new = max(0, u["completion_tokens"] - rec.tokens)
                        else:
                            new = 0 if counted else pieces
                        if new:
                            rec.tokens += new
                            if last is None:
                                rec.ttft = now - t0
                            else:
                                rec.gaps.append(now - last)
                            rec.gaps.extend([0.0] * (new - 1))  # tokens of one event
                            last = now
                    if slow:
                        await asyncio.sleep(cfg.slow_delay_s)
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as e:
            rec.detail = f"{type(e).__name__}: {e}"[:200]
            done = False
            if not rec.status:
                rec.outcome = "error"  # never got a response: not a stream that broke
        finally:
            self.active -= 1
            rec.end = rec.start + (time.monotonic() - t0)
            if rec.outcome == "pending":
                ref = None
                if self.verify_mode == "reference" and done and not error:
                    ref = await self._reference(session, path, body)
                rec.outcome = self._judge(rec, turn, "".join(texts), finish, done, error, ref)
            if self.workload is not None:
                finished = rec.outcome in ("ok", "corrupted")
                self.workload.done(user, turn, "".join(texts) if finished else None)
            self.records.append(rec)
            self.outcomes[rec.outcome] += 1
        return rec, retry_after

    def _judge(
        self,
        rec: Record,
        turn: Turn,
        text: str,
        finish: str | None,
        done: bool,
        error: bool,
        ref: str | None = None,
    ) -> str:
        if error or not done or finish is None:
            rec.detail = rec.detail or ("no finish" if done else "stream ended without [DONE]")
            return "dropped"
        want: str | None = None
        if self.verify_mode == "sim":
            want = turn.expected(self.cfg.sim_seed)
        elif self.verify_mode == "reference":
            if ref is None:
                rec.detail = "the reference engine gave no answer: not verified"
                return "ok"
            want = ref
        if want is not None and want != text:
            rec.detail = f"text differs at char {_diff_at(want, text)}"
            return "corrupted"
        return "ok"


def _diff_at(a: str, b: str) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))
