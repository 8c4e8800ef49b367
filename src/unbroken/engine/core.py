"""The engine core: continuous batching on its own thread, as vLLM's EngineCore runs apart
from its API server.

Each step admits waiting sequences while `max_num_seqs` and the KV cache allow (FCFS),
preempts the newest sequences when the cache cannot give every running sequence room for one
more token (they are recomputed on re-admission, as vLLM does), spends the step's modelled
time inside the stand-in CUDA calls, then produces one token per running sequence and hands
the batch to the event loop in a single thread-safe callback. The KV cache is vLLM v1's block
pool with prefix caching (`kvcache.KVCache`): an admitted sequence prefills only the tokens
its cached prefix blocks do not hold. With LoRA enabled (`max_loras`), at most that many
distinct adapters run at once: a waiting sequence of another adapter is skipped, keeping its
place, while later ones of a running adapter (or of the base model) are admitted, as vLLM v1's
scheduler does.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from unbroken.engine.cuda import CudaStub, Fn
from unbroken.engine.faults import Faults
from unbroken.engine.kvcache import Block, KVCache
from unbroken.engine.kvevents import KVCacheEvent
from unbroken.engine.profiles import EngineProfile
from unbroken.engine.textmodel import Cursor, StopChecker, piece_id, text_piece_id

__all__ = ["EngineCore", "Output", "Seq"]

log = logging.getLogger(__name__)


@dataclass(eq=False, slots=True)
class Seq:
    """One generated sequence (a request with n choices has n of them)."""

    request_id: str
    index: int
    prompt_tokens: int
    max_tokens: int
    cursor: Cursor
    stop: StopChecker
    sink: object  # the loop-side owner; opaque to the core
    min_tokens: int = 0
    ignore_eos: bool = False
    want_logprobs: bool = False
    generated: int = 0
    finished: bool = False
    scheduled: float | None = None  # monotonic time of first admission (queue time ends)
    # The prefix cache's view: prompt token ids then generated ones (empty: not cacheable),
    # the chained hashes of its full blocks, the blocks held while running and how many of
    # them are registered in the cache.
    token_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    blocks: list[Block] = field(default_factory=list)
    num_cached_blocks: int = 0
    cached_tokens: int = 0  # prompt tokens found in the cache at first admission
    computed: int = 0  # tokens whose KV is computed (cached hit + prefill chunks + decodes)
    lora: str | None = None  # the LoRA adapter it runs with (None: the base model)
    lora_id: int | None = None  # ... and its integer id (vLLM's lora_int_id; KV events)
    cache_salt: str | None = None  # the request's cache_salt (KV events' extra keys)
    cache_root: int = 0  # the parent hash of its first block (0: the cache's own root)
    n: int = 1  # its request's n: sequences index // n .. share one prompt (metrics)
    preemptions: int = 0  # times preempted (vllm:request_num_preemptions)
    # A constrained output (structured output, a forced tool call: structured.py), its pieces
    # drawn before the first step: produced one a step instead of the cursor's words, then
    # EOS (the grammar allows nothing else once complete).
    script: list[str] | None = None
    script_at: int = 0

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + self.generated


@dataclass(slots=True)
class Output:
    seq: Seq
    text: str
    finish_reason: str | None
    tokens: int  # tokens this output accounts for (0 or 1)
    logprob: float | None = None
    stop_reason: str | None = None  # the stop string that finished it (vLLM's stop_reason)


Deliver = Callable[[list[Output]], None]


class EngineCore:
    def __init__(
        self,
        profile: EngineProfile,
        deliver: Deliver,
        *,
        cuda: CudaStub | None = None,
        faults: Faults | None = None,
        on_step: Callable[[EngineCore, int, int], None] | None = None,
        cache_root: int = 0,
        max_loras: int | None = None,
        on_events: Callable[[list[KVCacheEvent]], None] | None = None,
    ) -> None:
        """`max_loras`: distinct adapters that may run at once (None: LoRA disabled).
        `on_events`: called on the engine thread with each step's KV events (vLLM's
        `--kv-events-config`; None: none recorded)."""
        self.profile = profile
        self.max_num_seqs = profile.max_num_seqs
        self.max_loras = max_loras
        self._deliver = deliver
        self._cuda = cuda
        self.faults = faults or Faults()
        self._contention_s = 0.0  # what the stub currently adds per contended call
        self._on_step = on_step
        self._cv = threading.Condition()
        self._inbox: list[Seq] = []
        self._aborts: set[str] = set()
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.kv = KVCache(
            profile.num_blocks,
            profile.block_size,
            enable_caching=profile.enable_prefix_caching,
            root=cache_root,
            events=on_events is not None,
        )
        self._on_events = on_events
        self._resets: list[tuple[bool, Future[bool]]] = []
        self.steps = 0
        self.preemptions = 0
        self.deferred = 0  # waiting sequences the last step set aside for the LoRA budget
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="engine-core", daemon=True)
        if cuda is not None:
            cuda.set_delay(Fn.CU_LAUNCH_KERNEL, profile.launch_overhead_s)
            cuda.set_delay(Fn.CU_GRAPH_LAUNCH, profile.launch_overhead_s * 2)
            cuda.set_delay(Fn.CU_MEMCPY_DTOH_ASYNC, profile.launch_overhead_s)

    # -- called from any thread -------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=5)

    def submit(self, seqs: list[Seq]) -> None:
        with self._cv:
            self._inbox.extend(seqs)
            self._cv.notify()

    def abort(self, request_id: str) -> None:
        with self._cv:
            self._aborts.add(request_id)
            self._cv.notify()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> Future[bool]:
        """vLLM's reset: done on the engine thread between steps; True once the cache is
        empty, False while sequences hold blocks (unless `reset_running_requests`, which
        preempts them first: they are recomputed on re-admission)."""
        fut: Future[bool] = Future()
        with self._cv:
            self._resets.append((reset_running_requests, fut))
            self._cv.notify()
        return fut

    def set_max_num_seqs(self, n: int) -> None:
        with self._cv:
            self.max_num_seqs = n
            self._cv.notify()

    @property
    def kv_usage(self) -> float:
        return self.kv.usage

    def lora_stats(self) -> tuple[dict[str, int], dict[str, int]]:
        """Requests per adapter, running and waiting (vLLM's SchedulerStats
        running_lora_adapters / waiting_lora_adapters), in first-seen order. Engine thread."""
        running: dict[str, int] = {}
        waiting: dict[str, int] = {}
        for s in self.running:
            if s.lora is not None:
                running[s.lora] = running.get(s.lora, 0) + 1
        for s in self.waiting:
            if s.lora is not None:
                waiting[s.lora] = waiting.get(s.lora, 0) + 1
        return running, waiting

    # -- the engine thread --------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._stop and not (
                        self._inbox or self._aborts or self.running or self.waiting or self._resets
                    ):
                        self._cv.wait(timeout=1.0)
                    if self._stop:
                        return
                    self.waiting.extend(self._inbox)
                    self._inbox.clear()
                    aborts, self._aborts = self._aborts, set()
                    resets, self._resets = self._resets, []
                if aborts:
                    self._drop(aborts)
                if resets:
                    self._reset(resets)
                    if not (self.running or self.waiting):
                        continue
                if (hang := self.faults.hang_remaining()) > 0:
                    time.sleep(min(0.02, hang))
                    continue
                self._step()
        except Exception:  # a bug here would silently freeze every stream: make it loud
            log.exception("engine core crashed")
            raise

    def _reset(self, resets: list[tuple[bool, Future[bool]]]) -> None:
        for preempt, fut in resets:
            if preempt:
                while self.running:  # newest first, so they are re-admitted in order
                    victim = self.running.pop()
                    self.kv.release(victim)
                    victim.computed = 0
                    victim.preemptions += 1
                    self.preemptions += 1
                    self.waiting.appendleft(victim)
            ok = self.kv.reset()
            if not ok:
                used = self.kv.num_blocks - self.kv.num_free
                log.warning("prefix cache not reset: %d blocks are still in use", used)
            fut.set_result(ok)
        self._publish()

    def _publish(self) -> None:
        if self._on_events is not None and (events := self.kv.take_events()):
            self._on_events(events)

    def _drop(self, ids: set[str]) -> None:
        keep = []
        for s in self.running:
            if s.request_id in ids:
                self.kv.release(s)
                s.finished = True
            else:
                keep.append(s)
        self.running = keep
        self.waiting = deque(s for s in self.waiting if s.request_id not in ids)

    def _step(self) -> None:
        """One scheduler step, as vLLM v1's scheduler makes it: a budget of
        `max_num_batched_tokens` tokens, spent first on the running sequences (one token each
        when decoding, the rest of an unfinished prefill otherwise) and then on waiting ones
        (FCFS), whose uncached prompt is cut to what the budget has left (chunked prefill).
        A sequence samples a token only in the step that computes the last of its tokens."""
        p = self.profile
        kv = self.kv
        budget = p.max_num_batched_tokens
        chunk: dict[int, int] = {}  # id(seq) -> tokens whose KV this step computes
        for s in self.running:
            c = min(s.num_tokens - s.computed, budget)
            chunk[id(s)] = c
            budget -= c
        outputs: list[Output] = []
        # Admit (FCFS) while slots, budget and KV allow. A sequence needs blocks for its
        # tokens plus the one it will produce; its cached prefix blocks need no prefill. A
        # sequence of an adapter that would exceed max_loras is set aside and keeps its place.
        loras = None if self.max_loras is None else {s.lora for s in self.running if s.lora}
        skipped: list[Seq] = []
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            s = self.waiting[0]
            if (
                loras is not None
                and s.lora is not None
                and s.lora not in loras
                and len(loras) >= self.max_loras  # type: ignore[operator]
            ):
                skipped.append(self.waiting.popleft())
                continue
            ntok = s.num_tokens
            need = kv.blocks_for(ntok + 1)
            hit = kv.lookup(s, ntok)
            if not kv.can_admit(hit, need):
                if self.running:
                    break
                # Nothing runs, so the whole cache is free: this sequence can never fit.
                self.waiting.popleft()
                outputs.append(self._too_long(s))
                continue
            self.waiting.popleft()
            if s.scheduled is None:
                s.scheduled = time.monotonic()
                s.cached_tokens = len(hit) * kv.block_size
                kv.record(ntok, len(hit))
            kv.admit(s, hit, need)
            s.computed = len(hit) * kv.block_size
            c = min(ntok - s.computed, budget)
            chunk[id(s)] = c
            budget -= c
            # Registered now (vLLM caches a step's blocks when it schedules them), so a
            # sibling admitted next can hit them.
            kv.cache_full(s, s.computed + c)
            self.running.append(s)
            if loras is not None and s.lora is not None:
                loras.add(s.lora)
        self.deferred = len(skipped)
        if skipped:
            self.waiting.extendleft(reversed(skipped))
        # Every running sequence needs room for one more token; preempt the newest until the
        # blocks that takes fit (vLLM frees a preempted request's blocks; cached ones stay).
        grow = sum(1 for s in self.running if kv.blocks_for(s.num_tokens + 1) > len(s.blocks))
        while self.running and grow > kv.num_free:
            victim = self.running.pop()
            if kv.blocks_for(victim.num_tokens + 1) > len(victim.blocks):
                grow -= 1
            kv.release(victim)
            victim.computed = 0
            if not self.running:  # it alone outgrew the cache
                outputs.append(self._too_long(victim))
                break
            self.waiting.appendleft(victim)
            victim.preemptions += 1
            self.preemptions += 1
        # Prefill: tokens computed for sequences not simply decoding their last sampled token.
        prefill = 0
        batch: list[Seq] = []
        for s in self.running:
            kv.grow(s, kv.blocks_for(s.num_tokens + 1))
            c = chunk[id(s)]
            if c == 0:
                continue  # no budget left for it this step: it keeps its blocks and waits
            kv.cache_full(s, s.computed + c)  # the KV this step computes
            if not (s.generated and c == 1 and s.computed == s.num_tokens - 1):
                prefill += c
            batch.append(s)
        if not batch:
            self._publish()
            if outputs:
                self._deliver(outputs)
            return
        self._spend(p.step_time(len(batch), prefill), prefill > 0)
        self.steps += 1
        still: list[Seq] = []
        for s in self.running:
            s.computed += chunk[id(s)]
            if s.computed >= s.num_tokens:  # its last token computed: it samples one
                out = self._advance(s)
                if out is not None:
                    outputs.append(out)
            if s.finished:
                kv.release(s)
            else:
                still.append(s)
        self.running = still
        self._publish()
        if self._on_step is not None:
            self._on_step(self, prefill, sum(o.tokens for o in outputs))
        if outputs:
            self._deliver(outputs)

    def _too_long(self, s: Seq) -> Output:
        """A sequence longer than the whole KV cache ends as if it reached max_tokens (vLLM
        refuses to start with a max_model_len its cache cannot hold)."""
        s.finished = True
        return Output(s, s.stop.flush(), "length", 0)

    def _advance(self, s: Seq) -> Output | None:
        lp = s.cursor.logprob() if s.want_logprobs else None
        if s.script is not None:
            if s.script_at >= len(s.script):
                s.finished = True
                return Output(s, s.stop.flush(), "stop", 0)
            piece = s.script[s.script_at]
            s.script_at += 1
            s.cursor.feed(piece)
            tid = text_piece_id(piece)
        else:
            piece, eos = s.cursor.next(allow_eos=not s.ignore_eos and s.generated >= s.min_tokens)
            if eos:
                s.finished = True
                return Output(s, s.stop.flush(), "stop", 0)
            tid = piece_id(piece) if s.token_ids else 0
        s.generated += 1
        if s.token_ids:
            s.token_ids.append(tid)
        text, stopped = s.stop.add(piece)
        if stopped:
            s.finished = True
            return Output(s, text, "stop", 1, lp, s.stop.matched)
        if s.generated >= s.max_tokens:
            s.finished = True
            return Output(s, text + s.stop.flush(), "length", 1, lp)
        return Output(s, text, None, 1, lp)

    def _spend(self, seconds: float, prefill: bool) -> None:
        """Spend a step's time where a GPU engine spends it: launches, one small copy of the
        sampled ids, and the wait in cudaStreamSynchronize. Contention (an injected episode)
        lengthens the launches and copies and stretches the device time the sync waits for."""
        cuda = self._cuda
        p = self.profile
        extra, factor = self.faults.cuda_penalty()
        seconds *= factor
        if cuda is None:
            launches = p.kernels_per_step if prefill else 2
            time.sleep(seconds + extra * (launches + 1))
            return
        if extra != self._contention_s:
            cuda.set_contention(extra)
            self._contention_s = extra
        if prefill:
            for _ in range(p.kernels_per_step - 2):
                cuda.launch_kernel()
            cuda.driver_launch_kernel()
            cuda.driver_launch_kernel()
            host_calls = p.kernels_per_step + 1
        else:
            cuda.graph_launch()
            host_calls = 3
        cuda.copy_to_host(4 * len(self.running))
        cuda.set_delay(
            Fn.CU_STREAM_SYNCHRONIZE, max(0.0, seconds - host_calls * p.launch_overhead_s)
        )
        cuda.synchronize()
