"""The engine simulator's HTTP server: vLLM's OpenAI-compatible API over the EngineCore.

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (with GET and
POST .../cancel of a stored response: responses.py), GET /v1/models, GET /health,
GET /metrics, and a bearer-protected /admin/* (faults, runtime config, state); with
VLLM_ALLOW_RUNTIME_LORA_UPDATING=True also POST /v1/load_lora_adapter and
/v1/unload_lora_adapter. Several served names and LoRA adapters as vLLM (`lora.py`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError

from unbroken.engine import cuda as cuda_mod
from unbroken.engine import messages as messages_mod
from unbroken.engine import responses as responses_mod
from unbroken.engine import structured
from unbroken.engine import tokenize as tokenize_mod
from unbroken.engine.core import EngineCore, Output, Seq
from unbroken.engine.faults import Config, FaultRequest, Faults
from unbroken.engine.kvcache import root_hash, salted_root
from unbroken.engine.kvevents import KVEventsConfig, ZmqEventPublisher
from unbroken.engine.lora import LoadedAdapter, LoRAModule, LoRARegistry, runtime_lora_updating
from unbroken.engine.metrics import EngineMetrics, FinishedSeq, cache_config_info
from unbroken.engine.profiles import EngineProfile
from unbroken.engine.render import ChatFormat, CompletionFormat
from unbroken.engine.request import (
    INT64_MAX,
    INT64_MIN,
    RequestState,
    client_request_id,
    max_tokens_for,
)
from unbroken.engine.textmodel import (
    StopChecker,
    TextModel,
    count_tokens,
    render_chat,
    sampling_salt,
    token_ids,
)
from unbroken.engine.weights import LoadReport, WeightError, WeightLoader, start_weights
from unbroken.wire.errors import ApiError, model_not_found
from unbroken.wire.heap import freeze_startup_heap
from unbroken.wire.http import (
    Cors,
    bearer_auth_middleware,
    error_middleware,
    prepare_sse,
    start_site,
)
from unbroken.wire.openai import (
    ChatRequest,
    CompletionRequest,
    lax_bool,
    parse_request,
    validation_message,
)

_SAMPLING_EPS = 1e-5  # vLLM's: a temperature below it is greedy sampling

_Format = (
    CompletionFormat | ChatFormat | responses_mod.ResponsesFormat | messages_mod.MessagesFormat
)

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
    # vLLM's `--served-model-name A B ...`: `model_name` is A (responses, metrics); these
    # further names are accepted in requests too.
    aliases: tuple[str, ...] = ()
    enable_lora: bool = False
    lora_modules: tuple[LoRAModule, ...] = ()
    max_loras: int = 1
    max_lora_rank: int = 16
    # /v1/load_lora_adapter and /v1/unload_lora_adapter; None: VLLM_ALLOW_RUNTIME_LORA_UPDATING.
    runtime_lora_updating: bool | None = None
    # vLLM's `--max-num-batched-tokens`: overrides the profile's (None: keep it).
    max_num_batched_tokens: int | None = None
    # vLLM's `--kv-events-config` (kvevents.py; None: no KV events).
    kv_events: KVEventsConfig | None = None
    # vLLM's `--allowed-origins`: CORS off by default, as vLLM 0.32 (`("*",)`: any origin).
    allowed_origins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens is not None:
            self.profile = self.profile.with_overrides(
                max_num_batched_tokens=self.max_num_batched_tokens
            )

    @property
    def served_model_names(self) -> list[str]:
        return [self.model_name, *(a for a in self.aliases if a != self.model_name)]

    def validate(self) -> None:
        """ValueError for what vLLM refuses at start."""
        if not self.model_name:
            raise ValueError("--served-model-name: a name must not be empty")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        if self.max_loras < 1:
            raise ValueError("--max-loras must be at least 1")
        if self.max_lora_rank < 1:
            raise ValueError("--max-lora-rank must be at least 1")
        names = [m.name for m in self.lora_modules]
        if len(set(names)) != len(names):
            raise ValueError("--lora-modules: an adapter name appears twice")


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
        cfg.validate()
        self.cfg = cfg
        self.model = TextModel(cfg.seed, cfg.eos_rate)
        self.names = cfg.served_model_names
        # /v1/models: vLLM stamps its cards with the time of the call and a new permission id;
        # the start time and one id keep a card the same across calls (the gateway's merged
        # list equals the engine's), with vLLM's fields and types.
        self._created = int(time.time())
        self._permission = {
            "id": f"modelperm-{uuid.uuid4().hex[:16]}",  # vLLM: 16 hex digits
            "object": "model_permission",
            "created": self._created,
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": True,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }
        self._base_names = frozenset(self.names)
        self.metrics = EngineMetrics(
            cfg.model_name, cfg.profile.max_model_len, cfg.max_loras if cfg.enable_lora else None
        )
        prof = cfg.profile
        self.metrics.log_cache_config(
            cache_config_info(
                block_size=prof.block_size,
                num_blocks=prof.num_blocks,
                enable_prefix_caching=prof.enable_prefix_caching,
                max_model_len=prof.max_model_len,
            )
        )
        self.loras: LoRARegistry | None = None
        self._adapter_models: dict[str, TextModel] = {}
        if cfg.enable_lora:
            self.loras = LoRARegistry(self.names)
            for m in cfg.lora_modules:
                a = self.loras.load(m.name, m.path, m.base_model_name)
                log.info("Loaded new LoRA adapter: name '%s', path '%s'", a.name, a.path)
        self.runtime_lora = (
            runtime_lora_updating()
            if cfg.runtime_lora_updating is None
            else cfg.runtime_lora_updating
        )
        self.faults = Faults()
        self.cuda: cuda_mod.CudaStub | None = None
        self.core: EngineCore | None = None
        self.states: dict[str, RequestState] = {}
        # Sequences aborted before they finished (client gone, error, shutdown): /admin/state's
        # only record of them, as vLLM's abort counts them in no metric.
        self.aborted = 0
        self.draining = False
        self.ready = False
        self.weights_report: LoadReport | None = None
        self.startup_s: float | None = None
        self._preemptions_seen = 0
        self._prefix_seen = (0, 0)  # the core's prefix-cache (queries, hits) last exported
        self.kv_events: ZmqEventPublisher | None = None  # open_kv_events
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

    def open_kv_events(self) -> None:
        """The KV events publisher of `--kv-events-config`, opened before the engine serves
        (vLLM's scheduler opens it at start); ValueError if its sockets cannot be opened."""
        kv = self.cfg.kv_events
        if kv is not None and kv.publishes and self.kv_events is None:
            self.kv_events = ZmqEventPublisher(kv)
            log.info(
                "KV events published on %s (topic %r%s)",
                kv.endpoint,
                kv.topic,
                f", replay on {kv.replay_endpoint}" if kv.replay_endpoint else "",
            )

    def close_kv_events(self) -> None:
        if self.kv_events is not None:
            self.kv_events.shutdown()

    def start_core(self, loop: asyncio.AbstractEventLoop) -> None:
        def deliver(outs: list[Output]) -> None:
            loop.call_soon_threadsafe(self._on_outputs, outs)

        def on_step(core: EngineCore, prefill: int, produced: int) -> None:
            m = self.metrics
            m.running.set(len(core.running))
            m.waiting.set(len(core.waiting))
            m.kv_usage.set(core.kv_usage)
            m.step(prefill + produced, len(core.waiting), core.deferred)
            if produced:
                m.generation_tokens.inc(produced)
            if core.preemptions > self._preemptions_seen:
                m.preemptions.inc(core.preemptions - self._preemptions_seen)
                self._preemptions_seen = core.preemptions
            queries, hits = core.kv.queries, core.kv.hits
            if queries > self._prefix_seen[0]:
                m.prefix_queries.inc(queries - self._prefix_seen[0])
                m.prefix_hits.inc(hits - self._prefix_seen[1])
                m.cached_device.inc(hits - self._prefix_seen[1])
                self._prefix_seen = (queries, hits)
            if m.lora is not None:
                m.lora.record(*core.lora_stats())

        self.core = EngineCore(
            self.cfg.profile,
            deliver,
            cuda=self.cuda,
            faults=self.faults,
            on_step=on_step,
            cache_root=root_hash(self.cfg.model_name),
            max_loras=self.cfg.max_loras if self.cfg.enable_lora else None,
            on_events=self.kv_events.publish if self.kv_events is not None else None,
        )
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
                    m.prefilled(o.seq.prompt_tokens, o.seq.cached_tokens)
                else:
                    m.itl.observe(now - st.last[i])
                st.last[i] = now
            if o.finish_reason is not None:
                first = st.first[i] or now
                m.finished(
                    FinishedSeq(
                        arrival=st.arrival,
                        scheduled=o.seq.scheduled or st.arrival,
                        first=first,
                        last=st.last[i] or first,
                        finish=now,
                        prompt=o.seq.prompt_tokens,
                        generated=st.tokens[i] + o.tokens,
                        cached=o.seq.cached_tokens,
                        max_tokens=o.seq.max_tokens,
                        preemptions=o.seq.preemptions,
                    ),
                    o.finish_reason,
                )
            st.deliver(o)
            if o.finish_reason is not None:
                n = o.seq.n
                group = range(i - i % n, i - i % n + n)
                if all(st.finish[j] is not None for j in group):
                    m.request_done(n, max(st.tokens[j] for j in group))
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
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_get("/v1/responses/{response_id}", self.responses_api.retrieve)
        app.router.add_post("/v1/responses/{response_id}/cancel", self.responses_api.cancel)
        app.router.add_post("/v1/messages", self.messages)
        app.router.add_post("/v1/messages/count_tokens", self.count_message_tokens)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        profile = self.cfg.profile.name

        async def say_profile(_request: web.Request, resp: web.StreamResponse) -> None:
            # Which precision served a request, through any proxy (the demo's standard
            # deployment is an L4 one): the share of critical tokens at reduced precision.
            resp.headers["X-Unbroken-Profile"] = profile

        app.on_response_prepare.append(say_profile)
        Cors(self.cfg.allowed_origins).install(app)
        app.router.add_get("/v1/models", self.models)
        if self.runtime_lora:
            log.warning(
                "LoRA dynamic loading & unloading is enabled in the API server. "
                "This should ONLY be used for local development!"
            )
            app.router.add_post("/v1/load_lora_adapter", self.load_lora_adapter)
            app.router.add_post("/v1/unload_lora_adapter", self.unload_lora_adapter)
        app.router.add_get("/health", self.health)
        # vLLM serves these always (its SageMaker router): the same answer as /health.
        app.router.add_get("/ping", self.health)
        app.router.add_post("/ping", self.health)
        app.router.add_get("/metrics", self.metrics_handler)
        app.router.add_get("/version", self.version)
        if os.environ.get("VLLM_SERVER_DEV_MODE", "0").strip() not in ("", "0"):
            # vLLM's development routes (VLLM_SERVER_DEV_MODE=1); of them, the cache reset.
            log.warning(
                "SECURITY WARNING: Development endpoints are enabled! "
                "This should NOT be used in production!"
            )
            app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        if self.cfg.admin_token:
            admin = web.Application(
                middlewares=[error_middleware, bearer_auth_middleware(self.cfg.admin_token)]
            )
            admin.router.add_get("/faults", self.get_faults)
            admin.router.add_post("/faults", self.post_fault)
            admin.router.add_delete("/faults", self.clear_faults)
            admin.router.add_get("/config", self.get_config)
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

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        """vLLM's POST /reset_prefix_cache: `{"success": false}` while requests hold blocks,
        unless `?reset_running_requests=true` preempts them first (they are recomputed)."""
        if self.core is None:
            raise ApiError(503, "The engine is starting", type="ServiceUnavailableError")
        preempt = _query_bool(request, "reset_running_requests")
        _query_bool(request, "reset_external")  # no connector here: nothing external to reset
        log.info("Resetting prefix cache...")
        ok = await asyncio.wrap_future(self.core.reset_prefix_cache(preempt))
        return web.json_response({"success": ok})

    async def version(self, request: web.Request) -> web.Response:
        from unbroken import __version__

        return web.json_response({"version": __version__, "engine": "unbroken-sim"})

    async def metrics_handler(self, request: web.Request) -> web.Response:
        """The Prometheus page in the classic text format, whatever Accept or Accept-Encoding
        ask, as vLLM 0.32's GET /metrics (prometheus-fastapi-instrumentator's route, added
        before the make_asgi_app mount, so it wins; it ignores the query too). Unlike vLLM,
        `?name[]=SAMPLE&name[]=...` restricts it to those samples, as prometheus_client's own
        exposition does: where vLLM's API server is a process of its own, a scrape delays its
        streams, not the engine's steps, while here the page's rendering (~6 ms for vLLM's
        series) holds the one process that also runs the steps, so the controller's five
        reads a second ask for the few series they parse."""
        body = self.metrics.render(request.query.getall("name[]", []))
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def models(self, request: web.Request) -> web.Response:
        """One card per served name, then one per adapter (`root` its path, `parent` its
        base), as vLLM's show_available_models."""
        created = self._created
        perm = [self._permission]
        cards: list[dict[str, Any]] = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "unbroken",  # vLLM says "vllm": `unbroken bench` tells them apart
                "root": self.cfg.model_name,  # vLLM: the one model's path, for every name
                "parent": None,
                "max_model_len": self.cfg.profile.max_model_len,
                "permission": perm,
            }
            for name in self.names
        ]
        if self.loras is not None:
            cards += [
                {
                    "id": a.name,
                    "object": "model",
                    "created": created,
                    "owned_by": "unbroken",
                    "root": a.path,
                    "parent": a.base_model_name,
                    "max_model_len": None,
                    "permission": perm,
                }
                for a in self.loras.adapters.values()
            ]
        return web.json_response(
            {"object": "list", "data": cards}, dumps=lambda o: orjson.dumps(o).decode()
        )

    # -- runtime LoRA (VLLM_ALLOW_RUNTIME_LORA_UPDATING) -------------------------------------
    @staticmethod
    def _lora_error(status: int, message: str, type_: str) -> web.Response:
        """vLLM's ErrorResponse for these routes: its own type names, the status as code."""
        body = {"error": {"message": message, "type": type_, "param": None, "code": status}}
        return web.json_response(body, status=status)

    async def _lora_body(self, request: web.Request) -> dict[str, Any] | web.Response:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as e:
            return self._lora_error(400, f"invalid JSON body: {e}", "BadRequestError")
        if not isinstance(body, dict):
            return self._lora_error(400, "the body must be a JSON object", "BadRequestError")
        return body

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        body = await self._lora_body(request)
        if isinstance(body, web.Response):
            return body
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path or not isinstance(name, str) or not isinstance(path, str):
            return self._lora_error(
                400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput"
            )
        if self.loras is None:
            return self._lora_error(
                400, "LoRA is not enabled. Use --enable-lora to enable LoRA.", "BadRequestError"
            )
        if self.loras.get(name) is not None and not body.get("load_inplace"):
            return self._lora_error(
                400, f"The lora adapter '{name}' has already been loaded.", "InvalidUserInput"
            )
        a = self.loras.load(name, path)
        log.info("Loaded new LoRA adapter: name '%s', path '%s'", a.name, a.path)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        body = await self._lora_body(request)
        if isinstance(body, web.Response):
            return body
        name = body.get("lora_name")
        if not name and not body.get("lora_int_id"):
            return self._lora_error(
                400,
                "either 'lora_name' and 'lora_int_id' needs to be provided.",
                "InvalidUserInput",
            )
        if not isinstance(name, str) or self.loras is None or self.loras.unload(name) is None:
            return self._lora_error(
                404, f"The lora adapter '{name}' cannot be found.", "NotFoundError"
            )
        self._adapter_models.pop(name, None)
        log.info("Removed LoRA adapter: name '%s'", name)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

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

    def _resolve(self, model: str | None) -> LoadedAdapter | None:
        """The adapter a request's `model` names (None: a served name of the base model, or
        no name: vLLM serves its model to a request without one); 404 as vLLM for anything
        else."""
        if not model or model in self._base_names:
            return None
        if self.loras is not None and (a := self.loras.get(model)) is not None:
            return a
        raise model_not_found(model)

    def _echo(self, model: str | None, adapter: LoadedAdapter | None) -> str:
        """The response's `model`, as vLLM's `_get_model_name`: the adapter's name, else
        the name the request asked for (an alias stays the alias), else the first served
        name."""
        if adapter is not None:
            return adapter.name
        return model or self.cfg.model_name

    def _text_model(self, adapter: LoadedAdapter | None) -> TextModel:
        if adapter is None:
            return self.model
        m = self._adapter_models.get(adapter.name)
        if m is None:
            m = self._adapter_models[adapter.name] = TextModel(
                self.cfg.seed, self.cfg.eos_rate, adapter.name
            )
        return m

    def _maybe_fail(self, state: RequestState) -> None:
        after = self.faults.draw_failure()
        if after == 0:
            raise ApiError(
                500, "injected failure", type="internal_server_error", code="injected_fault"
            )
        state.fail_after = after

    @staticmethod
    def _check_seed(req: CompletionRequest | ChatRequest) -> None:
        """vLLM bounds `seed` to int64 and answers 400 outside it."""
        if req.seed is not None and not INT64_MIN <= req.seed <= INT64_MAX:
            raise ApiError(
                400,
                f"seed must be between {INT64_MIN} and {INT64_MAX}",
                param="seed",
                code="invalid_value",
            )

    @staticmethod
    def _check_greedy_n(req: CompletionRequest | ChatRequest) -> None:
        """vLLM's SamplingParams refuse several choices of one greedy (temperature 0)
        request, which would all be the same text; a seeded sampled request is the
        reproducible way to ask for n (`textmodel.sampling_salt`)."""
        if req.n > 1 and req.temperature is not None and req.temperature < _SAMPLING_EPS:
            raise ApiError(
                400,
                f"n must be 1 when using greedy sampling, got {req.n}.",
                param="n",
                code="invalid_value",
            )

    def _salt(self, req: CompletionRequest | ChatRequest, index: int) -> bytes:
        if req.greedy:
            return b""
        if req.seed is not None:
            return sampling_salt(req.seed, index)
        return os.urandom(12)

    def _seqs(
        self,
        req: CompletionRequest | ChatRequest,
        state: RequestState,
        contexts: list[tuple[str, int]],
        max_tokens: list[int],
        adapter: LoadedAdapter | None = None,
        constraint: structured.Constraint | None = None,
    ) -> list[Seq]:
        """One sequence per prompt and choice; with a `constraint`, each carries its output's
        pieces, drawn from its own cursor (prompt, adapter, salt) so the value is as
        deterministic as the text."""
        seqs = []
        caching = self.cfg.profile.enable_prefix_caching
        model = self._text_model(adapter)
        lora = adapter.name if adapter is not None else None
        # An adapter's blocks never serve the base or another adapter (vLLM's block hashes
        # carry the LoRA id).
        root = root_hash(adapter.name) if adapter is not None else 0
        salt = getattr(req, "cache_salt", None)
        if salt:
            root = salted_root(root or root_hash(self.cfg.model_name), salt)
        for p, (ctx, ptoks) in enumerate(contexts):
            ids = token_ids(ctx) if caching else []
            for j in range(req.n):
                idx = p * req.n + j
                cursor = model.cursor(ctx, salt=self._salt(req, idx))
                script = None
                if constraint is not None:
                    script = structured.pieces(constraint.text(cursor.digest()))
                seqs.append(
                    Seq(
                        request_id=state.key,
                        index=idx,
                        prompt_tokens=ptoks,
                        max_tokens=max_tokens[p],
                        cursor=cursor,
                        script=script,
                        stop=StopChecker(req.stop_list),
                        sink=state,
                        min_tokens=req.min_tokens,
                        ignore_eos=req.ignore_eos,
                        want_logprobs=bool(req.logprobs is not None and req.logprobs is not False),
                        token_ids=ids if j == 0 else list(ids),  # each grows by its output
                        lora=lora,
                        lora_id=adapter.int_id if adapter is not None else None,
                        cache_salt=salt or None,
                        cache_root=root,
                        n=req.n,
                    )
                )
        return seqs

    def _submit(self, state: RequestState, seqs: list[Seq]) -> None:
        assert self.core is not None
        self.states[state.key] = state
        self._idle.clear()
        self.metrics.prompt_tokens.inc(sum(s.prompt_tokens for s in seqs))
        self.core.submit(seqs)

    def _release(self, state: RequestState) -> None:
        if self.states.pop(state.key, None) is not None and not state.done:
            assert self.core is not None
            self.core.abort(state.key)
            # Not counted in request_success_total{finished_reason="abort"}: vLLM 0.32's
            # AsyncLLM.abort drops the request's state (OutputProcessor.abort_requests) without
            # the finished-request stats; only the engine core's own aborts count there.
            for i, f in enumerate(state.finish):
                if f is None:
                    self.aborted += 1
                    state.finish[i] = "abort"
        if not self.states:
            self._idle.set()

    # -- /v1/completions ---------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        self._admit()
        req, raw = parse_request(CompletionRequest, await request.read())
        adapter = self._resolve(req.model)
        self._check_seed(req)
        self._check_greedy_n(req)
        constraint = structured.completion_constraint(raw)
        prompts = self._prompts(req.prompt)
        if req.max_tokens == 0 and not req.echo:
            raise ApiError(
                400, "max_tokens must be at least 1", param="max_tokens", code="invalid_value"
            )
        if req.suffix:
            raise ApiError(400, "suffix is not supported", param="suffix", code="unsupported")
        contexts = [(p, count_tokens(p)) for p in prompts]
        if any(t == 0 for _, t in contexts):
            # vLLM's processor refuses a prompt of no tokens (a tokenizer without a BOS, as
            # this one); the engine would never schedule it (a step samples a sequence's
            # token only once it computes its last prompt token).
            raise ApiError(400, "The decoder prompt cannot be empty", param="prompt")
        max_len = self.cfg.profile.max_model_len
        ids = not isinstance(req.prompt, str) and not all(isinstance(p, str) for p in req.prompt)
        limits = [
            max_tokens_for(t, req.max_tokens, max_len, "max_tokens", token_prompt=ids)
            for _, t in contexts
        ]
        rid = f"cmpl-{client_request_id(request.headers.get('X-Request-Id'))}"
        state = RequestState(rid, len(prompts) * req.n)
        self._maybe_fail(state)
        seqs = self._seqs(req, state, contexts, limits, adapter, constraint)
        if all(m == 0 for m in limits):
            for s in seqs:
                state.push(Output(s, "", "length", 0))
        else:
            self._submit(state, seqs)
        fmt = CompletionFormat(
            req,
            state,
            self._echo(req.model, adapter),
            prompts,
            sum(t for _, t in contexts),  # once per prompt, whatever n (vLLM 0.32)
        )
        return await self._answer(request, state, fmt, req.stream)

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
        req, raw = parse_request(ChatRequest, await request.read())
        adapter = self._resolve(req.model)
        self._check_seed(req)
        self._check_greedy_n(req)
        constraint, tools = structured.chat_constraint(raw)
        if req.top_logprobs and not req.logprobs:
            raise ApiError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
        if req.token_limit == 0:
            raise ApiError(400, "max_tokens must be at least 1", param="max_tokens")
        state, ptoks = self._start_chat(request, req, adapter, constraint)
        fmt = ChatFormat(req, state, self._echo(req.model, adapter), ptoks, tools)
        return await self._answer(request, state, fmt, req.stream)

    def _start_chat(
        self,
        request: web.Request,
        req: ChatRequest,
        adapter: LoadedAdapter | None,
        constraint: Any,
    ) -> tuple[RequestState, int]:
        """A chat request's context rendered, its token limit set as vLLM sets it, its
        sequences submitted: (its state, its prompt tokens). Chat's and the Messages API's,
        which vLLM serves as a chat request (its id `chatcmpl-...` too)."""
        ctx = render_chat(
            [(m.role, m.text()) for m in req.messages],
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
        )
        ptoks = count_tokens(ctx)
        param = "max_tokens" if req.max_completion_tokens is None else "max_completion_tokens"
        limit = max_tokens_for(ptoks, req.token_limit, self.cfg.profile.max_model_len, param)
        rid = f"chatcmpl-{client_request_id(request.headers.get('X-Request-Id'))}"
        state = RequestState(rid, req.n)
        self._maybe_fail(state)
        seqs = self._seqs(req, state, [(ctx, ptoks)], [limit], adapter, constraint)
        self._submit(state, seqs)
        return state, ptoks

    # -- /v1/messages (Anthropic's Messages API, as vLLM 0.32 serves it: messages.py) --------
    async def messages(self, request: web.Request) -> web.StreamResponse:
        try:
            self._admit()
            req, _ = parse_request(messages_mod.MessagesRequest, await request.read())
            adapter = self._resolve(req.model)
            chat = messages_mod.as_chat(req)
            self._check_seed(chat)
            state, ptoks = self._start_chat(request, chat, adapter, None)
        except ApiError as e:
            return messages_mod.anthropic_error(e.status, e.message)
        fmt = messages_mod.MessagesFormat(chat, state, self._echo(req.model, adapter), ptoks)
        return await self._answer(request, state, fmt, req.stream)

    async def count_message_tokens(self, request: web.Request) -> web.Response:
        try:
            req, _ = parse_request(messages_mod.CountTokensRequest, await request.read())
            self._resolve(req.model)
            pairs = messages_mod.conversation(req.system, req.messages)
        except ApiError as e:
            return messages_mod.anthropic_error(e.status, e.message)
        return web.json_response({"input_tokens": count_tokens(render_chat(pairs))})

    # -- /tokenize, /detokenize (tokenize.py) -------------------------------------------------
    async def tokenize(self, request: web.Request) -> web.Response:
        req = tokenize_mod.parse_tokenize(await request.read())
        self._resolve(req.model)
        return web.json_response(tokenize_mod.answer(req, self.cfg.profile.max_model_len))

    async def detokenize(self, request: web.Request) -> web.Response:
        req, _ = parse_request(tokenize_mod.DetokenizeRequest, await request.read())
        self._resolve(req.model)
        return web.json_response(tokenize_mod.detokenized(req))

    # -- /v1/responses (vLLM's Responses API, responses.py) ----------------------------------
    @functools.cached_property
    def responses_api(self) -> responses_mod.ResponsesAPI:
        return responses_mod.ResponsesAPI()

    async def responses(self, request: web.Request) -> web.StreamResponse:
        self._admit()
        api = self.responses_api
        req, _ = parse_request(responses_mod.ResponsesRequest, await request.read())
        adapter = self._resolve(req.model)
        self._check_seed(req)  # type: ignore[arg-type]
        responses_mod.validate(req, api.enabled)
        constraint, tools = responses_mod.constraint(req)
        api.effective_store(req)
        try:
            prev = api.previous(req)
        except KeyError:
            return responses_mod.not_found(req.previous_response_id or "")
        messages, cont = responses_mod.conversation(req, prev)
        ctx = render_chat(
            responses_mod.chat_pairs(messages),
            add_generation_prompt=not cont,
            continue_final_message=cont,
        )
        ptoks = count_tokens(ctx)
        max_tokens = responses_mod.output_limit(
            ptoks, req.max_output_tokens, self.cfg.profile.max_model_len
        )
        state = RequestState(req.request_id or f"resp_{responses_mod.random_id()}", 1)
        self._maybe_fail(state)
        seqs = self._seqs(req, state, [(ctx, ptoks)], [max_tokens], adapter, constraint)  # type: ignore[arg-type]
        self._submit(state, seqs)
        fmt = responses_mod.ResponsesFormat(
            req,
            state,
            self._echo(req.model, adapter),
            ptoks,
            max_tokens,
            messages=messages,
            store=api if req.store else None,
            tools=tools,
        )
        if req.background:

            async def run() -> None:
                try:
                    await self._collect(state, fmt)
                finally:
                    self._release(state)

            return api.start_background(fmt, run())
        return await self._answer(request, state, fmt, req.stream)

    # -- responses --------------------------------------------------------------------------
    async def _answer(
        self, request: web.Request, state: RequestState, fmt: _Format, stream: bool | None
    ) -> web.StreamResponse:
        """The request's answer, streamed or whole; its slots released either way."""
        try:
            if stream:
                return await self._stream(request, state, fmt)
            return await self._collect(state, fmt)
        finally:
            self._release(state)

    async def _stream(
        self, request: web.Request, state: RequestState, fmt: _Format
    ) -> web.StreamResponse:
        resp = await prepare_sse(request)
        # Outputs may skip this task once the headers are out (the first write carries them)
        # and the body is ours to frame: chunked, uncompressed, no injected failure to count.
        direct = (
            request.transport
            if resp.headers.get("Transfer-Encoding") == "chunked"
            and not resp.compression
            and state.fail_after is None
            and fmt.direct
            else None
        )
        state.render = fmt.chunk
        try:
            head = fmt.head()
            if head:
                await resp.write(head)
                state.direct = direct
            sent = 0
            async for batch in state.batches():
                parts = []
                for o in batch:
                    parts.append(fmt.chunk(o))
                    sent += o.tokens
                if state.fail_after is not None and sent >= state.fail_after:
                    parts.append(fmt.fault())
                    await resp.write(b"".join(parts))
                    return resp
                await resp.write(b"".join(p for p in parts if p))
                state.direct = direct
            await resp.write(fmt.end())
            await resp.write_eof()
        except ConnectionResetError:
            log.debug("client went away: %s", state.request_id)
        return resp

    async def _collect(self, state: RequestState, fmt: _Format) -> web.Response:
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

    async def get_faults(self, request: web.Request) -> web.Response:
        return web.json_response(self.faults.describe())

    async def post_fault(self, request: web.Request) -> web.Response:
        try:
            fault = FaultRequest.model_validate({"fault": orjson.loads(await request.read())}).fault
        except orjson.JSONDecodeError as e:
            raise ApiError(400, f"invalid JSON body: {e}") from None
        except ValidationError as e:
            msg, param = validation_message(e)
            raise ApiError(400, msg.removeprefix("fault."), param=param) from None
        log.warning("fault injected: %s", fault.model_dump())
        self.faults.apply(fault)
        if fault.kind == "crash":
            return web.json_response({"accepted": "crash"})
        return web.json_response({"accepted": fault.kind, "active": self.faults.describe()})

    async def clear_faults(self, request: web.Request) -> web.Response:
        self.faults.clear()
        log.warning("faults cleared")
        return web.json_response({"cleared": True})

    async def get_config(self, request: web.Request) -> web.Response:
        assert self.core is not None
        return web.json_response({"max_num_seqs": self.core.max_num_seqs})

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
                "served_model_names": self.names,
                "lora": None
                if self.loras is None
                else {
                    "max_loras": self.cfg.max_loras,
                    "max_lora_rank": self.cfg.max_lora_rank,
                    "runtime_updating": self.runtime_lora,
                    "adapters": {a.name: a.path for a in self.loras.adapters.values()},
                    "running": core.lora_stats()[0],
                    "waiting": core.lora_stats()[1],
                },
                "profile": self.cfg.profile.as_dict(),
                "running": len(core.running),
                "waiting": len(core.waiting),
                "kv_usage": core.kv_usage,
                "kv_events": None
                if self.kv_events is None
                else {
                    "endpoint": self.kv_events.cfg.endpoint,
                    "replay_endpoint": self.kv_events.cfg.replay_endpoint,
                    "topic": self.kv_events.cfg.topic,
                    "published": self.kv_events.published,
                    "dropped": self.kv_events.dropped,
                },
                "kv_cache": {
                    "blocks": core.kv.num_blocks,
                    "block_size": core.kv.block_size,
                    "free_blocks": core.kv.num_free,
                    "cached_blocks": len(core.kv.cached),
                    "evictions": core.kv.evictions,
                    "prefix_caching": core.kv.enable_caching,
                    "prefix_cache_queries": core.kv.queries,
                    "prefix_cache_hits": core.kv.hits,
                },
                "steps": core.steps,
                "preemptions": core.preemptions,
                "max_num_seqs": core.max_num_seqs,
                "requests": len(self.states),
                "aborted": self.aborted,
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
                "faults": self.faults.describe(),
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


async def serve(cfg: EngineConfig) -> None:
    started = _process_start_time()
    engine = Engine(cfg)
    loop = asyncio.get_running_loop()
    try:
        engine.open_kv_events()
    except ValueError as e:
        log.error("%s", e)
        raise SystemExit(1) from None
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
    freeze_startup_heap()
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
    # What drain left is aborted now, as vLLM does: aiohttp's own grace (start_site's 2 s)
    # would otherwise let short streams finish even with --shutdown-timeout 0.
    runner._shutdown_timeout = 0.05
    await runner.cleanup()
    if engine.core is not None:
        engine.core.stop()
    engine.close_kv_events()
    log.info("engine stopped")


def _query_bool(request: web.Request, name: str) -> bool:
    """A FastAPI `bool` query parameter (absent: false), read as pydantic's lax mode reads
    one; else a 400 (vLLM: 422) naming it."""
    raw = request.query.get(name)
    if raw is None:
        return False
    v = lax_bool(raw)
    if v is None:
        raise ApiError(400, f"{name}: input should be a valid boolean, got {raw!r}", param=name)
    return v


def run_engine(cfg: EngineConfig) -> None:
    import uvloop

    uvloop.run(serve(cfg))
