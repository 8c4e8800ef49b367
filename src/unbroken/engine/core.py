"""The engine core: continuous batching on its own thread, as vLLM's EngineCore runs apart
from its API server.

Each step admits waiting sequences while `max_num_seqs` and the KV cache allow (FCFS),
preempts the newest sequences when the cache cannot hold one more token per sequence (they
are recomputed on re-admission, as vLLM does), spends the step's modelled time inside the
stand-in CUDA calls, then produces one token per running sequence and hands the batch to the
event loop in a single thread-safe callback.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from unbroken.engine.cuda import CudaStub, Fn
from unbroken.engine.faults import Faults
from unbroken.engine.profiles import EngineProfile
from unbroken.engine.textmodel import Cursor, StopChecker

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
    kv: int = 0  # KV slots held while running
    finished: bool = False
    scheduled: float | None = None  # monotonic time of first admission (queue time ends)


@dataclass(slots=True)
class Output:
    seq: Seq
    text: str
    finish_reason: str | None
    tokens: int  # tokens this output accounts for (0 or 1)
    logprob: float | None = None


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
    ) -> None:
        self.profile = profile
        self.max_num_seqs = profile.max_num_seqs
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
        self.kv_used = 0
        self.steps = 0
        self.preemptions = 0
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

    def set_max_num_seqs(self, n: int) -> None:
        with self._cv:
            self.max_num_seqs = n
            self._cv.notify()

    @property
    def kv_usage(self) -> float:
        return self.kv_used / self.profile.kv_capacity_tokens

    # -- the engine thread --------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._stop and not (
                        self._inbox or self._aborts or self.running or self.waiting
                    ):
                        self._cv.wait(timeout=1.0)
                    if self._stop:
                        return
                    self.waiting.extend(self._inbox)
                    self._inbox.clear()
                    aborts, self._aborts = self._aborts, set()
                if aborts:
                    self._drop(aborts)
                if (hang := self.faults.hang_remaining()) > 0:
                    time.sleep(min(0.02, hang))
                    continue
                self._step()
        except Exception:  # a bug here would silently freeze every stream: make it loud
            log.exception("engine core crashed")
            raise

    def _drop(self, ids: set[str]) -> None:
        keep = []
        for s in self.running:
            if s.request_id in ids:
                self.kv_used -= s.kv
                s.kv = 0
                s.finished = True
            else:
                keep.append(s)
        self.running = keep
        self.waiting = deque(s for s in self.waiting if s.request_id not in ids)

    def _step(self) -> None:
        p = self.profile
        prefill = 0
        # Admit (FCFS) while slots and KV allow.
        while self.waiting and len(self.running) < self.max_num_seqs:
            s = self.waiting[0]
            need = s.prompt_tokens + s.generated + 1
            if self.kv_used + need > p.kv_capacity_tokens and self.running:
                break
            self.waiting.popleft()
            if s.scheduled is None:
                s.scheduled = time.monotonic()
            s.kv = need - 1
            self.kv_used += s.kv
            prefill += s.kv
            self.running.append(s)
        # Every running sequence needs one more slot; preempt the newest until they fit.
        while self.running and self.kv_used + len(self.running) > p.kv_capacity_tokens:
            victim = self.running.pop()
            self.kv_used -= victim.kv
            victim.kv = 0
            self.waiting.appendleft(victim)
            self.preemptions += 1
        if not self.running:
            return
        self._spend(p.step_time(len(self.running), prefill), prefill > 0)
        self.steps += 1
        outputs: list[Output] = []
        still: list[Seq] = []
        for s in self.running:
            out = self._advance(s)
            if out is not None:
                outputs.append(out)
            if s.finished:
                self.kv_used -= s.kv
                s.kv = 0
            else:
                still.append(s)
        self.running = still
        if self._on_step is not None:
            self._on_step(self, prefill, sum(o.tokens for o in outputs))
        if outputs:
            self._deliver(outputs)

    def _advance(self, s: Seq) -> Output | None:
        lp = s.cursor.logprob() if s.want_logprobs else None
        piece, eos = s.cursor.next(allow_eos=not s.ignore_eos and s.generated >= s.min_tokens)
        if eos:
            s.finished = True
            return Output(s, s.stop.flush(), "stop", 0)
        s.generated += 1
        s.kv += 1
        self.kv_used += 1
        text, stopped = s.stop.add(piece)
        if stopped:
            s.finished = True
            return Output(s, text, "stop", 1, lp)
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
