"""The engine simulator's HTTP server: vLLM's OpenAI-compatible API over the EngineCore.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
GET /metrics, and a bearer-protected /admin/* (faults, runtime config, state).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from unbroken.engine import cuda as cuda_mod
from unbroken.engine.core import EngineCore, Output, Seq
from unbroken.engine.faults import Config, Fail, FaultRequest, Hang, SlowCuda
from unbroken.engine.metrics import EngineMetrics
from unbroken.engine.profiles import EngineProfile
from unbroken.engine.textmodel import StopChecker, TextModel, count_tokens, render_chat
from unbroken.engine.weights import LoadReport, WeightError, WeightLoader, start_weights
from unbroken.wire.errors import ApiError
from unbroken.wire.http import bearer_auth_middleware, error_middleware, prepare_sse, start_site
from unbroken.wire.openai import (
    ChatRequest,
    CompletionRequest,
    parse_request,
    validation_message,
)
from unbroken.wire.sse import encode_data, encode_json

__all__ = ["Engine", "EngineConfig", "run_engine"]

log = logging.getLogger("unbroken.engine")


@dataclass
class EngineConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str = "unbroken-sim"
    profile: EngineProfile = field(default_factory=lambda: EngineProfile("fp16"))
    seed: int = 0
    eos_rate: float = 0.0
    weights: Path | None = None
    # Started by the caller before importing this module, so the read overlaps the imports;
    # started here when absent.
    weights_loader: WeightLoader | None = None
    admin_token: str | None = None
    shutdown_timeout: float = 30.0
    max_body_bytes: int = 16 * 2**20
    use_cuda_stub: bool = True


class RequestState:
    """Loop-side state of one HTTP request: outputs handed over by the core, per choice."""

    __slots__ = (
        "arrival",
        "created",
        "event",
        "fail_after",
        "finish",
        "first",
        "last",
        "n",
        "pending",
        "remaining",
        "request_id",
        "texts",
        "tokens",
    )

    def __init__(self, request_id: str, n: int) -> None:
        self.request_id = request_id
        self.n = n
        self.created = int(time.time())
        self.arrival = time.monotonic()
        self.pending: list[Output] = []
        self.event = asyncio.Event()
        self.remaining = n
        self.first: list[float | None] = [None] * n
        self.last = [0.0] * n
        self.tokens = [0] * n
        self.texts: list[list[str]] = [[] for _ in range(n)]
        self.finish: list[str | None] = [None] * n
        self.fail_after: int | None = None

    def push(self, out: Output) -> None:
        self.pending.append(out)
        i = out.seq.index
        self.tokens[i] += out.tokens
        if out.finish_reason is not None:
            self.finish[i] = out.finish_reason
            self.remaining -= 1
        self.event.set()

    @property
    def done(self) -> bool:
        return self.remaining == 0

    async def batches(self) -> AsyncIterator[list[Output]]:
        while True:
            if not self.pending:
                if self.remaining == 0:
                    return
                self.event.clear()
                await self.event.wait()
                continue
            batch, self.pending = self.pending, []
            yield batch


def _request_id(request: web.Request) -> str:
    """vLLM's convention: a caller's X-Request-Id becomes the request id."""
    rid = request.headers.get("X-Request-Id", "")
    return rid if 0 < len(rid) <= 128 and rid.isprintable() else uuid.uuid4().hex


def _process_start_time() -> float:
    """Wall-clock time this process started, from /proc (so interpreter start counts)."""
    try:
        stat = Path("/proc/self/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


class Engine:
    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self.model = TextModel(cfg.seed, cfg.eos_rate)
        self.metrics = EngineMetrics(cfg.model_name)
        self.cuda: cuda_mod.CudaStub | None = None
        self.core: EngineCore | None = None
        self.states: dict[str, RequestState] = {}
        self.draining = False
        self.ready = False
        self.fail: Fail | None = None
        self.weights_report: LoadReport | None = None
        self.startup_s: float | None = None
        self._fault_timers: dict[str, asyncio.TimerHandle] = {}
        self._preemptions_seen = 0
        self._idle = asyncio.Event()
        self._idle.set()

    # -- start-up ---------------------------------------------------------------------------
    def load(self) -> None:
        if self.cfg.use_cuda_stub:
            try:
                self.cuda = cuda_mod.load()
            except (cuda_mod.StubBuildError, OSError) as e:
                log.warning("stand-in CUDA library unavailable, timing in pure Python: %s", e)
        else:
            log.warning("stand-in CUDA library disabled, timing in pure Python")
        self.metrics.cuda_stub.set(1 if self.cuda else 0)
        if self.cfg.weights is not None:
            loader = self.cfg.weights_loader or start_weights(
                self.cfg.weights, self.cfg.use_cuda_stub
            )
            self.weights_report = r = loader.wait()
            self.metrics.weights_load.set(r.seconds)
            self.metrics.weights_bytes.set(r.bytes)
            log.info(
                "weights: %d files, %d tensors, %.2f GB in %.3f s (%.2f GB/s)",
                r.files,
                r.tensors,
                r.bytes / 1e9,
                r.seconds,
                r.gbps,
            )

    def start_core(self, loop: asyncio.AbstractEventLoop) -> None:
        def deliver(outs: list[Output]) -> None:
            loop.call_soon_threadsafe(self._on_outputs, outs)

        def on_step(core: EngineCore, prefill: int, produced: int) -> None:
            m = self.metrics
            m.running.set(len(core.running))
            m.waiting.set(len(core.waiting))
            m.kv_usage.set(core.kv_usage)
            if produced:
                m.generation_tokens.inc(produced)
            if core.preemptions > self._preemptions_seen:
                m.preemptions.inc(core.preemptions - self._preemptions_seen)
                self._preemptions_seen = core.preemptions

        self.core = EngineCore(self.cfg.profile, deliver, cuda=self.cuda, on_step=on_step)
        self.core.start()

    def _on_outputs(self, outs: list[Output]) -> None:
        now = time.monotonic()
        m = self.metrics
        for o in outs:
            st = o.seq.sink
            assert isinstance(st, RequestState)
            i = o.seq.index
            if o.tokens:
                if st.first[i] is None:
                    st.first[i] = now
                    m.ttft.observe(now - st.arrival)
                else:
                    m.itl.observe(now - st.last[i])
                st.last[i] = now
            if o.finish_reason is not None:
                m.e2e.observe(now - st.arrival)
                m.success(o.finish_reason)
            st.push(o)
        if self.core is not None and not self.core.running:
            m.running.set(0)
            m.kv_usage.set(self.core.kv_usage)

    # -- app ----------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.cfg.max_body_bytes, middlewares=[error_middleware]
        )
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_handler)
        app.router.add_get("/version", self.version)
        if self.cfg.admin_token:
            admin = web.Application(
                middlewares=[error_middleware, bearer_auth_middleware(self.cfg.admin_token)]
            )
            admin.router.add_get("/faults", self.get_faults)
            admin.router.add_post("/faults", self.post_fault)
            admin.router.add_delete("/faults", self.clear_faults)
            admin.router.add_post("/config", self.post_config)
            admin.router.add_get("/state", self.get_state)
            app.add_subapp("/admin/", admin)
        else:
            app.router.add_route("*", "/admin/{tail:.*}", self.admin_disabled)
        return app

    async def health(self, request: web.Request) -> web.Response:
        if self.draining or not self.ready:
            return web.Response(status=503, text="shutting down" if self.draining else "starting")
        return web.Response(status=200)

    async def version(self, request: web.Request) -> web.Response:
        from unbroken import __version__

        return web.json_response({"version": __version__, "engine": "unbroken-sim"})

    async def metrics_handler(self, request: web.Request) -> web.Response:
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def models(self, request: web.Request) -> web.Response:
        name = self.cfg.model_name
        card = {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "unbroken",
            "root": name,
            "parent": None,
            "max_model_len": self.cfg.profile.max_model_len,
        }
        return web.json_response(
            {"object": "list", "data": [card]}, dumps=lambda o: orjson.dumps(o).decode()
        )

    # -- admission ------------------------------------------------------------------------
    def _admit(self) -> None:
        if self.draining:
            raise ApiError(
                503,
                "the engine is shutting down",
                code="shutting_down",
                headers={"Retry-After": "1"},
            )
        if not self.ready:
            raise ApiError(
                503, "the engine is starting", code="starting", headers={"Retry-After": "1"}
            )

    def _check_model(self, model: str) -> None:
        if model != self.cfg.model_name:
            raise ApiError(
                404, f"The model `{model}` does not exist.", param="model", code="model_not_found"
            )

    def _limit(self, prompt_tokens: int, requested: int | None, what: str) -> int:
        max_len = self.cfg.profile.max_model_len
        if requested is None:
            requested = max_len - prompt_tokens
            if requested <= 0:
                raise ApiError(
                    400,
                    f"This model's maximum context length is {max_len} tokens. "
                    f"However, your {what} has {prompt_tokens} tokens.",
                    param="messages",
                    code="context_length_exceeded",
                )
        if prompt_tokens + requested > max_len:
            raise ApiError(
                400,
                f"This model's maximum context length is {max_len} tokens. However, you "
                f"requested {prompt_tokens + requested} tokens ({prompt_tokens} in the {what}, "
                f"{requested} in the completion). Please reduce the length of the {what} or "
                "completion.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return requested

    def _maybe_fail(self, state: RequestState) -> None:
        f = self.fail
        if f is None or random.random() >= f.fraction:
            return
        if f.after_tokens is None:
            raise ApiError(
                500, "injected failure", type="internal_server_error", code="injected_fault"
            )
        state.fail_after = f.after_tokens

    def _salt(self, req: CompletionRequest | ChatRequest, index: int) -> bytes:
        if req.greedy:
            return b""
        if req.seed is not None:
            return req.seed.to_bytes(8, "little", signed=True) + index.to_bytes(4, "little")
        return os.urandom(12)

    def _seqs(
        self,
        req: CompletionRequest | ChatRequest,
        state: RequestState,
        contexts: list[tuple[str, int]],
        max_tokens: list[int],
    ) -> list[Seq]:
        seqs = []
        for p, (ctx, ptoks) in enumerate(contexts):
            for j in range(req.n):
                idx = p * req.n + j
                seqs.append(
                    Seq(
                        request_id=state.request_id,
                        index=idx,
                        prompt_tokens=ptoks,
                        max_tokens=max_tokens[p],
                        cursor=self.model.cursor(ctx, salt=self._salt(req, idx)),
                        stop=StopChecker(req.stop_list),
                        sink=state,
                        min_tokens=req.min_tokens,
                        ignore_eos=req.ignore_eos,
                        want_logprobs=bool(req.logprobs is not None and req.logprobs is not False),
                    )
                )
        return seqs

    def _submit(self, state: RequestState, seqs: list[Seq]) -> None:
        assert self.core is not None
        self.states[state.request_id] = state
        self._idle.clear()
        self.metrics.prompt_tokens.inc(sum(s.prompt_tokens for s in seqs))
        self.core.submit(seqs)

    def _release(self, state: RequestState) -> None:
        if self.states.pop(state.request_id, None) is not None and not state.done:
            assert self.core is not None
            self.core.abort(state.request_id)
            for i, f in enumerate(state.finish):
                if f is None:
                    self.metrics.success("abort")
                    state.finish[i] = "abort"
        if not self.states:
            self._idle.set()

    # -- /v1/completions ---------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        self._admit()
        req, _ = parse_request(CompletionRequest, await request.read())
        self._check_model(req.model)
        prompts = self._prompts(req.prompt)
        if req.max_tokens == 0 and not req.echo:
            raise ApiError(
                400, "max_tokens must be at least 1", param="max_tokens", code="invalid_value"
            )
        if req.suffix:
            raise ApiError(400, "suffix is not supported", param="suffix", code="unsupported")
        contexts = [(p, count_tokens(p)) for p in prompts]
        limits = [self._limit(t, req.max_tokens, "prompt") for _, t in contexts]
        rid = f"cmpl-{_request_id(request)}"
        state = RequestState(rid, len(prompts) * req.n)
        self._maybe_fail(state)
        seqs = self._seqs(req, state, contexts, limits)
        if all(m == 0 for m in limits):
            for s in seqs:
                state.push(Output(s, "", "length", 0))
        else:
            self._submit(state, seqs)
        fmt = _CompletionFormat(
            req, state, self.cfg.model_name, prompts, sum(t for _, t in contexts) * req.n
        )
        try:
            if req.stream:
                return await self._stream(request, state, fmt)
            return await self._collect(state, fmt)
        finally:
            self._release(state)

    def _prompts(self, prompt: Any) -> list[str]:
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, int) for p in prompt):
            return [self.model.token_text(prompt)]
        if all(isinstance(p, list) and p for p in prompt):
            return [self.model.token_text(p) for p in prompt]
        raise ApiError(400, "prompt: token id lists must not be empty", param="prompt")

    # -- /v1/chat/completions -------------------------------------------------------------
    async def chat(self, request: web.Request) -> web.StreamResponse:
        self._admit()
        req, _ = parse_request(ChatRequest, await request.read())
        self._check_model(req.model)
        if req.response_format and req.response_format.get("type") not in (None, "text"):
            raise ApiError(
                400,
                "structured output (response_format) is not supported by the simulator",
                param="response_format",
                code="unsupported",
            )
        if req.tool_choice not in (None, "none", "auto"):
            raise ApiError(
                400,
                "forced tool calls are not supported by the simulator",
                param="tool_choice",
                code="unsupported",
            )
        if req.top_logprobs and not req.logprobs:
            raise ApiError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
        limit = req.token_limit
        if limit == 0:
            raise ApiError(400, "max_tokens must be at least 1", param="max_tokens")
        ctx = render_chat(
            [(m.role, m.text()) for m in req.messages],
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
        )
        ptoks = count_tokens(ctx)
        max_tokens = self._limit(ptoks, limit, "messages")
        rid = f"chatcmpl-{_request_id(request)}"
        state = RequestState(rid, req.n)
        self._maybe_fail(state)
        self._submit(state, self._seqs(req, state, [(ctx, ptoks)], [max_tokens]))
        fmt = _ChatFormat(req, state, self.cfg.model_name, ptoks)
        try:
            if req.stream:
                return await self._stream(request, state, fmt)
            return await self._collect(state, fmt)
        finally:
            self._release(state)

    # -- responses --------------------------------------------------------------------------
    async def _stream(
        self, request: web.Request, state: RequestState, fmt: _CompletionFormat | _ChatFormat
    ) -> web.StreamResponse:
        resp = await prepare_sse(request)
        try:
            head = fmt.head()
            if head:
                await resp.write(head)
            sent = 0
            async for batch in state.batches():
                parts = []
                for o in batch:
                    parts.append(fmt.chunk(o))
                    sent += o.tokens
                if state.fail_after is not None and sent >= state.fail_after:
                    parts.append(
                        encode_json(
                            {
                                "error": {
                                    "message": "injected failure mid-stream",
                                    "type": "internal_server_error",
                                    "param": None,
                                    "code": 500,
                                }
                            }
                        )
                    )
                    parts.append(encode_data(b"[DONE]"))
                    await resp.write(b"".join(parts))
                    return resp
                await resp.write(b"".join(p for p in parts if p))
            tail = fmt.usage_chunk()
            await resp.write((tail or b"") + encode_data(b"[DONE]"))
            await resp.write_eof()
        except ConnectionResetError:
            log.debug("client went away: %s", state.request_id)
        return resp

    async def _collect(
        self, state: RequestState, fmt: _CompletionFormat | _ChatFormat
    ) -> web.Response:
        async for batch in state.batches():
            for o in batch:
                fmt.collect(o)
                if state.fail_after is not None and sum(state.tokens) >= state.fail_after:
                    raise ApiError(500, "injected failure", code="injected_fault")
        return web.Response(body=orjson.dumps(fmt.full()), content_type="application/json")

    # -- admin ----------------------------------------------------------------------------------
    async def admin_disabled(self, request: web.Request) -> web.Response:
        raise ApiError(
            403,
            "the admin API is disabled (start the engine with --admin-token or "
            "UNBROKEN_ADMIN_TOKEN)",
            code="admin_disabled",
        )

    def _faults(self) -> dict[str, Any]:
        now = time.monotonic()
        core = self.core
        out: dict[str, Any] = {}
        if core and core.contention_s:
            out["slow_cuda"] = {"extra_ms": core.contention_s * 1e3}
        if core and core.hang_until > now:
            out["hang"] = {"remaining_s": round(core.hang_until - now, 3)}
        if self.fail:
            out["fail"] = self.fail.model_dump(exclude={"kind"})
        return out

    async def get_faults(self, request: web.Request) -> web.Response:
        return web.json_response(self._faults())

    async def post_fault(self, request: web.Request) -> web.Response:
        try:
            fault = FaultRequest.model_validate({"fault": orjson.loads(await request.read())}).fault
        except orjson.JSONDecodeError as e:
            raise ApiError(400, f"invalid JSON body: {e}") from None
        except ValidationError as e:
            msg, param = validation_message(e)
            raise ApiError(400, msg.removeprefix("fault."), param=param) from None
        assert self.core is not None
        log.warning("fault injected: %s", fault.model_dump())
        if fault.kind == "crash":
            # Answer first so the caller knows it was taken, then die like a real crash.
            asyncio.get_running_loop().call_later(0.05, os.kill, os.getpid(), signal.SIGKILL)
            return web.json_response({"accepted": "crash"})
        if isinstance(fault, SlowCuda):
            self.core.set_contention(fault.extra_ms / 1e3)
            self._expire(
                "slow_cuda",
                fault.duration_s,
                lambda: self.core.set_contention(0.0) if self.core else None,
            )
        elif isinstance(fault, Hang):
            self.core.hang_until = time.monotonic() + fault.duration_s
        elif isinstance(fault, Fail):
            self.fail = fault
            self._expire("fail", fault.duration_s, lambda: setattr(self, "fail", None))
        self.metrics.faults.labels(fault.kind).set(1)
        return web.json_response({"accepted": fault.kind, "active": self._faults()})

    def _expire(self, kind: str, after: float | None, clear: Callable[[], object]) -> None:
        if (h := self._fault_timers.pop(kind, None)) is not None:
            h.cancel()
        if after is None:
            return

        def done() -> None:
            clear()
            self.metrics.faults.labels(kind).set(0)
            self._fault_timers.pop(kind, None)

        self._fault_timers[kind] = asyncio.get_running_loop().call_later(after, done)

    async def clear_faults(self, request: web.Request) -> web.Response:
        assert self.core is not None
        for h in self._fault_timers.values():
            h.cancel()
        self._fault_timers.clear()
        self.core.set_contention(0.0)
        self.core.hang_until = 0.0
        self.fail = None
        for kind in ("slow_cuda", "hang", "fail"):
            self.metrics.faults.labels(kind).set(0)
        return web.json_response({"cleared": True})

    async def post_config(self, request: web.Request) -> web.Response:
        try:
            cfg = Config.model_validate(orjson.loads(await request.read()))
        except orjson.JSONDecodeError as e:
            raise ApiError(400, f"invalid JSON body: {e}") from None
        except ValidationError as e:
            msg, param = validation_message(e)
            raise ApiError(400, msg, param=param) from None
        assert self.core is not None
        if cfg.max_num_seqs is not None:
            self.core.set_max_num_seqs(cfg.max_num_seqs)
        return web.json_response({"max_num_seqs": self.core.max_num_seqs})

    async def get_state(self, request: web.Request) -> web.Response:
        core = self.core
        assert core is not None
        w = self.weights_report
        return web.json_response(
            {
                "pid": os.getpid(),
                "model": self.cfg.model_name,
                "profile": self.cfg.profile.as_dict(),
                "running": len(core.running),
                "waiting": len(core.waiting),
                "kv_usage": core.kv_usage,
                "steps": core.steps,
                "preemptions": core.preemptions,
                "max_num_seqs": core.max_num_seqs,
                "requests": len(self.states),
                "cuda_stub": str(self.cuda.directory) if self.cuda else None,
                "startup_s": self.startup_s,
                "weights": None
                if w is None
                else {
                    "files": w.files,
                    "tensors": w.tensors,
                    "bytes": w.bytes,
                    "seconds": w.seconds,
                },
                "faults": self._faults(),
                "draining": self.draining,
            }
        )

    # -- shutdown -----------------------------------------------------------------------------
    async def drain(self, timeout: float) -> None:
        """vLLM semantics on SIGTERM: refuse new work, let in-flight requests finish up to
        `timeout`, then stop."""
        self.draining = True
        n = len(self.states)
        log.info("shutting down: %d request(s) in flight, waiting up to %.0f s", n, timeout)
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            log.warning("shutdown timeout: aborting %d request(s)", len(self.states))


class _Format:
    """What completions and chat streams share: usage options, the response envelope and the
    usage chunk."""

    chunk_object = ""
    full_object = ""

    def __init__(
        self,
        req: CompletionRequest | ChatRequest,
        state: RequestState,
        model: str,
        prompt_tokens: int,
    ) -> None:
        self.state, self.model = state, model
        self.prompt_tokens = prompt_tokens  # counted once, by the handler
        self.usage_on = bool(req.stream_options and req.stream_options.include_usage)
        self.continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)

    def _usage(self) -> dict[str, int]:
        p, c = self.prompt_tokens, sum(self.state.tokens)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def _envelope(
        self, choices: list[dict[str, Any]], *, usage: bool, full: bool = False
    ) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "id": self.state.request_id,
            "object": self.full_object if full else self.chunk_object,
            "created": self.state.created,
            "model": self.model,
            "choices": choices,
        }
        if usage:
            obj["usage"] = self._usage()
        return obj

    def usage_chunk(self) -> bytes | None:
        if not self.usage_on:
            return None
        return encode_json(self._envelope([], usage=True))


class _CompletionFormat(_Format):
    chunk_object = full_object = "text_completion"

    def __init__(
        self,
        req: CompletionRequest,
        state: RequestState,
        model: str,
        prompts: list[str],
        prompt_tokens: int,
    ) -> None:
        super().__init__(req, state, model, prompt_tokens)
        self.req, self.prompts = req, prompts
        self.offsets = [0] * state.n
        self.echoed = [False] * state.n
        self.lp: list[dict[str, list[Any]]] = [
            {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            for _ in range(state.n)
        ]

    def _prefix(self, i: int) -> str:
        if self.req.echo and not self.echoed[i]:
            self.echoed[i] = True
            return self.prompts[i // self.req.n]
        return ""

    def _logprobs(self, o: Output) -> dict[str, Any] | None:
        if self.req.logprobs is None or o.logprob is None:
            return None
        i = o.seq.index
        d = {
            "tokens": [o.text],
            "token_logprobs": [o.logprob],
            "top_logprobs": [{o.text: o.logprob}] if self.req.logprobs else None,
            "text_offset": [self.offsets[i]],
        }
        self.offsets[i] += len(o.text)
        return d

    def head(self) -> bytes:
        return b""

    def chunk(self, o: Output) -> bytes:
        text = self._prefix(o.seq.index) + o.text
        if not text and o.finish_reason is None:
            return b""
        choice = {
            "index": o.seq.index,
            "text": text,
            "logprobs": self._logprobs(o),
            "finish_reason": o.finish_reason,
            "stop_reason": None,
        }
        return encode_json(self._envelope([choice], usage=self.continuous))

    def collect(self, o: Output) -> None:
        i = o.seq.index
        self.state.texts[i].append(self._prefix(i) + o.text)
        if (lp := self._logprobs(o)) is not None:
            for k, v in lp.items():
                self.lp[i][k].extend(v or [])

    def full(self) -> dict[str, Any]:
        st = self.state
        choices = [
            {
                "index": i,
                "text": "".join(st.texts[i]),
                "logprobs": self.lp[i] if self.req.logprobs is not None else None,
                "finish_reason": st.finish[i],
                "stop_reason": None,
            }
            for i in range(st.n)
        ]
        return self._envelope(choices, usage=True, full=True)


class _ChatFormat(_Format):
    chunk_object = "chat.completion.chunk"
    full_object = "chat.completion"

    def __init__(
        self, req: ChatRequest, state: RequestState, model: str, prompt_tokens: int
    ) -> None:
        super().__init__(req, state, model, prompt_tokens)
        self.req = req
        self.lp: list[list[dict[str, Any]]] = [[] for _ in range(state.n)]

    def _logprobs(self, o: Output) -> dict[str, Any] | None:
        if not self.req.logprobs or o.logprob is None:
            return None
        entry = {"token": o.text, "logprob": o.logprob, "bytes": list(o.text.encode())}
        top = [dict(entry)] if self.req.top_logprobs else []
        return {"content": [{**entry, "top_logprobs": top}]}

    def head(self) -> bytes:
        return b"".join(
            encode_json(
                self._envelope(
                    [
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                    usage=self.continuous,
                )
            )
            for i in range(self.state.n)
        )

    def chunk(self, o: Output) -> bytes:
        if not o.text and o.finish_reason is None:
            return b""
        delta = {"content": o.text} if o.text or o.finish_reason is None else {}
        return encode_json(
            self._envelope(
                [
                    {
                        "index": o.seq.index,
                        "delta": delta,
                        "logprobs": self._logprobs(o),
                        "finish_reason": o.finish_reason,
                    }
                ],
                usage=self.continuous,
            )
        )

    def collect(self, o: Output) -> None:
        self.state.texts[o.seq.index].append(o.text)
        if (lp := self._logprobs(o)) is not None:
            self.lp[o.seq.index].extend(lp["content"])

    def full(self) -> dict[str, Any]:
        st = self.state
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": "".join(st.texts[i])},
                "logprobs": {"content": self.lp[i]} if self.req.logprobs else None,
                "finish_reason": st.finish[i],
                "stop_reason": None,
            }
            for i in range(st.n)
        ]
        return self._envelope(choices, usage=True, full=True)


async def serve(cfg: EngineConfig) -> None:
    started = _process_start_time()
    engine = Engine(cfg)
    loop = asyncio.get_running_loop()
    # Weights load off the loop thread: the process answers 503 "starting" meanwhile.
    runner = await start_site(engine.app(), cfg.host, cfg.port)
    log.info(
        "engine listening on http://%s:%d (model %s, profile %s)",
        cfg.host,
        cfg.port,
        cfg.model_name,
        cfg.profile.name,
    )
    try:
        await loop.run_in_executor(None, engine.load)
    except (WeightError, OSError) as e:
        log.error("cannot load weights from %s: %s", cfg.weights, e)
        await runner.cleanup()
        raise SystemExit(1) from None
    engine.start_core(loop)
    engine.ready = True
    engine.startup_s = time.time() - started
    engine.metrics.startup.set(engine.startup_s)
    w = engine.weights_report
    log.info("ready in %.2f s (weights %.2f s)", engine.startup_s, w.seconds if w else 0.0)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await engine.drain(cfg.shutdown_timeout)
    await runner.cleanup()
    if engine.core is not None:
        engine.core.stop()
    log.info("engine stopped")


def run_engine(cfg: EngineConfig) -> None:
    import uvloop

    uvloop.run(serve(cfg))
