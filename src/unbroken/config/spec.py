"""The pipeline spec: one YAML file describing pools of engines and the gateway in front of
them. Validation errors name the offending field (`pools.0.replicas: ...`)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal, get_args
from urllib.parse import urlsplit

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from unbroken.config._base import Priority, _Spec
from unbroken.config.tenants import (
    REDIS_SCHEMES,
    RateLimitSettings,
    TenantSpec,
    check_tenants,
)

__all__ = [
    "AdapterSpec",
    "AgentSettings",
    "ControllerSettings",
    "EngineSpec",
    "GatewaySettings",
    "PipelineSpec",
    "PoolSpec",
    "ReplicaRange",
    "ScalingSpec",
    "SpecError",
    "default_spec",
    "format_errors",
    "load_spec",
]

Name = Annotated[
    str, Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")
]


class SpecError(ValueError):
    """A spec that cannot be used; the message names the field."""


# Routing policies by the names of the peers users come from: vllm-router's and SGLang's
# `--policy` (`cache_aware`, `consistent_hash`; `round_robin`, `power_of_two` and `random`
# are ours too) and production-stack's `--routing-logic` (`roundrobin`, `prefixaware`;
# `session` is ours).
ROUTING_ALIASES = {
    "cache_aware": "prefix",
    "consistent_hash": "session",
    "roundrobin": "round_robin",
    "prefixaware": "prefix",
}

# Peers' policies with no counterpart here, and what to use instead.
_NO_KV_EVENTS = (
    "routing from the engines' KV events is not built here; `prefix` routes by an index of "
    "what was sent where (docs/gateway.md, 'Routing policies')"
)
ROUTING_HINTS = {
    "kv_aware": _NO_KV_EVENTS,
    "kvaware": _NO_KV_EVENTS,
    "sticky_least_loaded": "a conversation kept on its replica while it has room is `session`",
}


class GatewaySettings(_Spec):
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8080
    admin_host: str = "127.0.0.1"
    admin_port: Annotated[int, Field(ge=0, le=65535)] = 8081
    priority_header: str = "x-unbroken-priority"
    default_priority: Priority = "standard"
    priority_keys: dict[str, Priority] = Field(
        default_factory=dict, description="API key → priority class"
    )
    routes: dict[Priority, list[str]] = Field(
        default_factory=dict, description="priority → pools in order of preference"
    )
    default_cap: Annotated[int, Field(ge=1)] = 256
    queue_timeout_s: Annotated[float, Field(gt=0)] = 30.0
    max_attempts: Annotated[int, Field(ge=1, le=10)] = 3
    max_body_bytes: Annotated[int, Field(ge=1024)] = 8 * 2**20
    stream_buffer_bytes: Annotated[int, Field(ge=4096)] = 4 * 2**20
    # One SSE event from an engine larger than this breaks its leg (docs/gateway.md).
    max_sse_event_bytes: Annotated[int, Field(ge=65536)] = 16 * 2**20
    probe_interval_s: Annotated[float, Field(gt=0)] = 1.0
    health_fail_threshold: Annotated[int, Field(ge=1)] = 2
    warmup_timeout_s: Annotated[float, Field(gt=0)] = 30.0
    connect_timeout_s: Annotated[float, Field(gt=0)] = 2.0
    drain_deadline_s: Annotated[float, Field(ge=0)] = 30.0
    stall_timeout_s: Annotated[float, Field(gt=0)] = 10.0
    max_migrations: Annotated[int, Field(ge=0, le=20)] = 3
    # Hardening (docs/gateway.md, "Limits"): hung engines, slow or hostile clients, memory.
    ttfb_timeout_s: Annotated[float, Field(gt=0)] = 30.0
    ttfb_min_s: Annotated[float, Field(gt=0)] = 5.0
    request_timeout_s: Annotated[float, Field(gt=0)] = 600.0
    header_timeout_s: Annotated[float, Field(gt=0)] = 10.0
    body_timeout_s: Annotated[float, Field(gt=0)] = 30.0
    max_connections_per_client: Annotated[int, Field(ge=1)] = 1024
    max_queue: Annotated[int, Field(ge=0)] = 1024
    max_queue_bytes: Annotated[int, Field(ge=0)] = 64 * 2**20
    stream_buffer_budget_bytes: Annotated[int, Field(ge=4096)] = 256 * 2**20
    max_sequences_per_request: Annotated[int, Field(ge=1)] = 128
    endpoint_header: bool = Field(
        default=True, description="send X-Unbroken-Endpoint (names internal endpoints)"
    )
    upstream_key_env: dict[str, str] = Field(
        default_factory=dict,
        description="pool → env var holding its engines' API key (vLLM --api-key); `*`: "
        "every pool without its own",
    )
    # Routing (docs/gateway.md, "Routing"): the policy by name, and its knobs.
    routing: Literal[
        "prefix", "session", "latency", "least_load", "power_of_two", "round_robin", "random"
    ] = Field(
        default="prefix",
        description="routing policy: prefix (cache- and session-aware, the default), session, "
        "latency, least_load, power_of_two, round_robin, random; the peers' cache_aware, "
        "consistent_hash, roundrobin and prefixaware are read as prefix, session, round_robin "
        "and prefix",
    )
    session_header: str = Field(
        default="x-session-id",
        description="header naming a conversation (else the body's `prompt_cache_key`, else "
        "its `user`, else an `X-User-ID` header): session affinity",
    )
    ttft_target_ms: dict[Priority, Annotated[float, Field(gt=0)] | None] = Field(
        default_factory=dict,
        description="first-token target per priority: standard and sheddable work spills to a "
        "later pool of its route only when the first misses it (absent or null: whenever the "
        "later pool is clearly faster); critical work never spills while its pool has room",
    )
    slo_spill_ratio: Annotated[float, Field(gt=1)] | None = Field(
        default=1.5,
        description="a later pool must be this many times better (load included) to take "
        "standard or sheddable work; null: no SLO spill",
    )
    slo_spill_min_load: Annotated[float, Field(ge=0)] = Field(
        default=16.0,
        description="the first pool's best endpoint spills nothing below this load "
        "(in flight + engine queue + KV)",
    )
    prefill_us_per_token: Annotated[float, Field(ge=0)] = Field(
        default=40.0, description="what prefilling one uncached prompt token costs (µs)"
    )
    prefix_block_chars: Annotated[int, Field(ge=8, le=4096)] = 64
    prefix_balance_abs: Annotated[float, Field(ge=0)] = Field(
        default=8.0,
        description="`prefix` / `session`: the hot-spot guard's slack: a candidate loaded "
        "above the least loaded's x (1 + prefix_balance_rel) + this gets no credit for what "
        "it holds (vllm-router's --balance-abs-threshold plays this part, with other arithmetic)",
    )
    prefix_balance_rel: Annotated[float, Field(ge=0)] = Field(
        default=0.25,
        description="`prefix` / `session`: the guard's relative part (above); also a session "
        "home's bound, the candidates' mean in flight x (1 + this) + 1",
    )
    prefix_index_blocks: Annotated[int, Field(ge=1)] = Field(
        default=16384, description="prefix index bound per endpoint, in blocks (LRU)"
    )
    prefix_share_url: str | None = Field(
        default=None,
        description="Redis (redis://, rediss://, unix://) through which gateway replicas tell "
        "each other what they sent where, so that each one's prefix index knows all of it; "
        "None: each replica knows its own (docs/gateway.md, 'Across gateway replicas')",
    )
    nice: Annotated[int, Field(ge=-20, le=19)] = Field(
        default=-5,
        description="under `unbroken up`: the gateway's CPU priority (its session's nice and "
        "autogroup), above the engines' 0 so that on a shared machine a starting replica's "
        "weight read delays the engines' steps, not the relay of every stream (docs/pipeline.md); "
        "0: off; a negative value needs root (CAP_SYS_NICE), else it is skipped with a warning",
    )
    cors_allowed_origins: list[str] = Field(
        default_factory=list,
        description="origins a browser app may call the API from (CORS, as vLLM's "
        "--allowed-origins; [] as vLLM 0.32's default: no cross-origin browser access, "
        "preflights answered 400; ['*'] for every origin)",
    )
    accept_pack_cpu: Annotated[float, Field(ge=0, le=8)] = Field(
        default=0.5,
        description="with several workers: the lowest-numbered worker takes every new client "
        "connection while its CPU is under this share of a core (and its connections under "
        "accept_pack_conns), so that light load costs one process's CPU per token, not two "
        "half-busy ones'; past it connections spread evenly; 0: always spread",
    )
    accept_pack_conns: Annotated[int, Field(ge=1)] = Field(
        default=512, description="a packing worker's connections before new ones spread"
    )
    handover_on_reload: bool = Field(
        default=True,
        description="at a reload, hand open streams with their client connections to the new "
        "workers (continued by continuation), so old workers exit in seconds",
    )

    # Filled from the spec's top-level `tenants:` and `rate_limit:` (render_gateway_settings);
    # a standalone gateway's config file may set them here directly.
    tenants: list[TenantSpec] | None = None
    rate_limit: RateLimitSettings = Field(default_factory=RateLimitSettings)
    # The names (model, aliases, adapters) each pool serves, from the spec
    # (`PipelineSpec.gateway_settings`). The gateway learns names from live replicas; these
    # are known before any replica of a pool runs: a request for a name only a sleeping
    # (autoscaled to 0) pool serves waits in the queue for it instead of a 404, and counts
    # as that pool's demand, which wakes it.
    pool_models: dict[str, list[str]] = Field(default_factory=dict)
    # The pools that may be at zero replicas on purpose (autoscaled with `min: 0`): only
    # these are "asleep" when none of their replicas runs; another pool with none is down
    # (crashing, being replaced), and a client is told that instead.
    sleeping_pools: list[str] = Field(default_factory=list)
    # Each adapter the spec declares: its base (vLLM's `parent`) and path (`root`), so that
    # /v1/models lists a sleeping pool's adapters as vLLM lists them, under their base.
    adapter_cards: dict[str, dict[str, str]] = Field(default_factory=dict)

    @field_validator("routing", mode="before")
    @classmethod
    def _routing_alias(cls, v: Any) -> Any:
        """A policy by the name a user brings from a peer router (`ROUTING_ALIASES`); an
        unknown name is refused with ours and theirs listed."""
        if not isinstance(v, str):
            return v
        ours = get_args(cls.model_fields["routing"].annotation)
        if v not in ours and v not in ROUTING_ALIASES:
            hint = f"{ROUTING_HINTS[v]}; " if v in ROUTING_HINTS else ""
            raise ValueError(
                f"unknown routing policy {v!r}: {hint}one of {', '.join(ours)} (also the peers' "
                + ", ".join(f"{k} = {a}" for k, a in ROUTING_ALIASES.items())
                + ")"
            )
        return ROUTING_ALIASES.get(v, v)

    @field_validator("prefix_share_url")
    @classmethod
    def _share_scheme(cls, url: str | None) -> str | None:
        if url is not None and urlsplit(url).scheme.lower() not in REDIS_SCHEMES:
            # Only the scheme may be echoed: the rest may hold a password.
            raise ValueError("must start with redis://, rediss:// or unix://")
        return url

    @field_validator("session_header")
    @classmethod
    def _header_name(cls, v: str) -> str:
        """A header a client can send (an HTTP token), and not one that carries something
        else: a name no request can carry turned session routing off without a word, and
        `authorization` made every API key a conversation."""
        if not re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", v):
            raise ValueError(f"{v!r} is not an HTTP header name (letters, digits, -, ...)")
        if v.lower() in ("authorization", "cookie", "host", "content-type", "content-length"):
            raise ValueError(f"{v} carries something else; name a header of its own")
        return v

    @model_validator(mode="after")
    def _tenants(self) -> GatewaySettings:
        if self.tenants is not None:
            check_tenants(self.tenants)
        return self


class ControllerSettings(_Spec):
    """The adaptive loop (docs/controller.md). Ratios compare a signal with the endpoint's own
    learned baseline; dwell times keep conditions from flapping."""

    enabled: bool = True
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8082
    interval_s: Annotated[float, Field(gt=0, le=5)] = 0.2
    # CUDA launch/copy call latency (agent) against its baseline.
    cuda_enter_ratio: Annotated[float, Field(gt=1)] = 3.0
    cuda_exit_ratio: Annotated[float, Field(gt=1)] = 1.5
    cuda_quantile: Annotated[float, Field(gt=0, lt=1)] = 0.5
    min_excess_ms: Annotated[float, Field(ge=0)] = 0.1
    # A window this far above the CUDA baseline enters `contended` at once, without the
    # dwell (null: always dwell). The dwell guards against noise; a launch median ten times
    # its own normal is not noise, and the dwell's 0.2 s is when new requests still land on
    # the slowing device (the demo's contention tail).
    cuda_strong_ratio: Annotated[float, Field(gt=1)] | None = 10.0
    # Engine inter-token latency against the baseline predicted for its batch size.
    itl_enter_ratio: Annotated[float, Field(gt=1)] = 1.6
    itl_exit_ratio: Annotated[float, Field(gt=1)] = 1.2
    # A smaller ITL excess is scheduling noise (a busy host), not a contended device.
    min_itl_excess_ms: Annotated[float, Field(ge=0)] = 5.0
    # Socket-seconds per second at >= the agent's threshold above which the slowdown is
    # blamed on the network/clients, not the device (the seed's rule).
    backpressure_max: Annotated[float, Field(ge=0)] = 0.5
    enter_dwell_s: Annotated[float, Field(ge=0)] = 0.2
    exit_dwell_s: Annotated[float, Field(ge=0)] = 3.0
    min_dwell_s: Annotated[float, Field(ge=0)] = 2.0
    recover_step_s: Annotated[float, Field(gt=0)] = 2.0
    baseline_windows: Annotated[int, Field(ge=1)] = 8
    # On contention, move the endpoint's running standard and sheddable streams elsewhere by
    # continuation (they would stall until they end); critical streams stay.
    move_streams: bool = True
    # ... paced: this many streams every move_every_s (null: all at once). Each moved stream
    # prefills its prompt and output again on the next endpoint; all at once, that prefill
    # lands in front of every new request there.
    move_batch: Annotated[int, Field(ge=1)] | None = 8
    move_every_s: Annotated[float, Field(gt=0, le=10)] = 0.1
    cap_factor: Annotated[float, Field(gt=0, le=1)] = 0.5
    min_cap: Annotated[int, Field(ge=1)] = 2
    # Pools by tier; empty = derived from pool precision (fp16/bf16 full, the rest degraded).
    full_pools: list[str] = Field(default_factory=list)
    degraded_pools: list[str] = Field(default_factory=list)
    # Dynamic precision (off when convert_after_s is null): convert a contended full-precision
    # replica to the degraded tier through the zero-downtime rollout, and back.
    convert_after_s: Annotated[float, Field(gt=0)] | None = None
    convert_back_after_s: Annotated[float, Field(gt=0)] = 60.0
    min_full_replicas: Annotated[int, Field(ge=0)] = 1
    # Each pool's configured engine max_num_seqs (`unbroken up` fills it from the engine
    # profile and overrides): what a lowered engine is restored to, also by a controller
    # that did not lower it (restarted mid-episode). Unset pools: read from the engine.
    engine_max_num_seqs: dict[str, Annotated[int, Field(ge=1)]] = Field(default_factory=dict)
    # Where the controller keeps what must outlive its process (learned baselines, the
    # original max_num_seqs of engines it lowered); `unbroken up` puts it in the state
    # directory. null: in memory only.
    state_file: str | None = None

    @model_validator(mode="after")
    def _check(self) -> ControllerSettings:
        if self.cuda_exit_ratio >= self.cuda_enter_ratio:
            raise ValueError("cuda_exit_ratio must be below cuda_enter_ratio")
        if self.cuda_strong_ratio is not None and self.cuda_strong_ratio < self.cuda_enter_ratio:
            raise ValueError("cuda_strong_ratio must be at least cuda_enter_ratio")
        if self.itl_exit_ratio >= self.itl_enter_ratio:
            raise ValueError("itl_exit_ratio must be below itl_enter_ratio")
        both = [p for p in self.full_pools if p in self.degraded_pools]
        if both:
            raise ValueError(
                f"full_pools and degraded_pools both name pool(s): {', '.join(both)} "
                "(a pool is one tier or the other)"
            )
        return self


class AgentSettings(_Spec):
    """The node agent under `unbroken up`: started when running as root ("auto")."""

    enabled: bool | Literal["auto"] = "auto"
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 9101


class ProfileOverrides(_Spec):
    max_num_seqs: Annotated[int, Field(ge=1)] | None = None
    kv_capacity_tokens: Annotated[int, Field(ge=1)] | None = None
    max_model_len: Annotated[int, Field(ge=1)] | None = None
    prefill_per_token_s: Annotated[float, Field(ge=0)] | None = None
    decode_base_s: Annotated[float, Field(ge=0)] | None = None
    decode_per_seq_s: Annotated[float, Field(ge=0)] | None = None
    block_size: Annotated[int, Field(ge=1, le=1024)] | None = None
    enable_prefix_caching: bool | None = None

    def args(self) -> list[str]:
        out: list[str] = []
        for k, v in self.model_dump(exclude_none=True).items():
            flag = f"--{k.replace('_', '-')}"
            if isinstance(v, bool):
                out.append(flag if v else f"--no-{flag[2:]}")
            else:
                out += [flag, str(v)]
        return out


# A replica's liveness check, the livenessProbe `unbroken render k8s` gives engines and the
# local supervisor's own (pipeline/replicas.py): /health every `engine.liveness_period_s`,
# each allowed LIVENESS_TIMEOUT_S (at most the period), LIVENESS_FAILURES failures in a row
# and it is restarted (killed and replaced under `unbroken up`).
LIVENESS_TIMEOUT_S = 5
LIVENESS_FAILURES = 3


class EngineSpec(_Spec):
    """Either the built-in simulator with a profile, or any command (real `vllm serve`).
    In a command, `{port}`, `{host}` and `{model}` are substituted."""

    kind: Literal["simulator", "command"] = "simulator"
    profile: Literal["fp16", "fp8"] = "fp16"
    overrides: ProfileOverrides = Field(default_factory=ProfileOverrides)
    command: list[str] | None = None
    env: dict[str, str] = Field(default_factory=dict)
    seed: int = 0
    eos_rate: Annotated[float, Field(ge=0, lt=1)] = 0.0
    shutdown_timeout_s: Annotated[float, Field(ge=0)] = 30.0
    # How long a starting replica may take to answer /health (its imports and weight load:
    # minutes for a large model on vLLM) before its start fails: at `unbroken up`, in a
    # rollout's or resize's surge, and when a dead replica is replaced.
    health_timeout_s: Annotated[float, Field(gt=0)] = 120.0
    # Seconds between liveness checks of a replica that serves (LIVENESS_FAILURES failures
    # in a row: restarted), locally and in the rendered livenessProbe's periodSeconds.
    liveness_period_s: Annotated[int, Field(ge=1, le=300)] = 10
    # CPU niceness of a starting replica (its whole process group) until it answers /health,
    # then back to 0: a replica started beside serving ones (rollout surge, a crash's
    # replacement) takes only spare CPU for its imports and weight load. 0: off. Only used
    # where the supervisor may return it to 0 (root, or RLIMIT_NICE allows).
    startup_nice: Annotated[int, Field(ge=0, le=19)] = 10
    # CPU quota, in cores, of a replica started while others of the pipeline serve, until it
    # answers /health (pipeline/cpucap.py): bounds what its imports and weight read take
    # from them where a nice value does not. 0: off. Needs root and a cgroup cpu controller;
    # elsewhere it is skipped with one warning.
    startup_cpu: Annotated[float, Field(ge=0)] = 0.5
    # For this long a quota'd starting replica runs only on CPU the serving processes leave
    # idle (its cgroup's cpu.idle: SCHED_IDLE, preempted at once by any serving thread that
    # wakes); then on its quota alone, so that a saturated node still starts it. 0: off.
    startup_idle_s: Annotated[float, Field(ge=0)] = 10.0

    @property
    def liveness_timeout_s(self) -> int:
        return min(LIVENESS_TIMEOUT_S, self.liveness_period_s)

    @model_validator(mode="after")
    def _check(self) -> EngineSpec:
        if self.kind == "command" and not self.command:
            raise ValueError("an engine of kind 'command' needs a command")
        if self.kind == "simulator" and self.command:
            raise ValueError("command is only for kind 'command'")
        return self


class ReplicaRange(_Spec):
    """An autoscaled pool's range, written `replicas: {min, max}` (at most 64 replicas)."""

    min: Annotated[int, Field(ge=0, le=64)] = 1
    max: Annotated[int, Field(ge=1, le=64)]

    @model_validator(mode="after")
    def _order(self) -> ReplicaRange:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must not exceed max ({self.max})")
        return self


class ScalingSpec(_Spec):
    """How an autoscaled pool (`replicas: {min, max}`) sizes itself (controller/autoscale.py
    decides). The signal is the gateway's own view, read every `interval_s`: the pool's
    demand, its streams in flight plus those queued for it
    (`unbroken_gateway_pool_demand`), per replica, against `target`, as Kubernetes' HPA
    does: desired = ceil(demand / target). `target` may not exceed the pool's cap (checked
    by PipelineSpec): a replica never holds more than its cap, so demand over the cap queues
    in the gateway and a higher target would never scale the pool out."""

    target: Annotated[float, Field(gt=0)] = 48.0
    interval_s: Annotated[float, Field(gt=0, le=10)] = 0.5
    # Ignore a ratio within this much of 1 (the HPA's tolerance): no flapping at the target.
    tolerance: Annotated[float, Field(ge=0, lt=1)] = 0.1
    # Scale up at most this often (each step may add several replicas, in proportion).
    up_cooldown_s: Annotated[float, Field(ge=0)] = 2.0
    # Scale down only after demand has wanted fewer replicas for this long, one at a time,
    # at most every `down_cooldown_s`.
    down_quiet_s: Annotated[float, Field(ge=0)] = 30.0
    down_cooldown_s: Annotated[float, Field(ge=0)] = 10.0
    # A scale-down drains the replica for up to this long, then migrates what is left.
    drain_deadline_s: Annotated[float, Field(ge=0)] = 10.0


class AdapterSpec(_Spec):
    """A LoRA adapter a pool serves: vLLM's `--lora-modules name=path`."""

    name: Annotated[str, Field(min_length=1, max_length=256)]
    path: str | None = None
    base: str | None = None  # the model it applies to; the pool's by default


def _adapters(v: Any) -> Any:
    """`adapters:` as a list of names or {name, path}, or a mapping of name to path."""
    if isinstance(v, dict):
        return [{"name": k, "path": p} for k, p in v.items()]
    if isinstance(v, list):
        return [{"name": a} if isinstance(a, str) else a for a in v]
    return v


class PoolSpec(_Spec):
    name: Name
    precision: Literal["fp16", "bf16", "fp8", "int8", "int4", "awq"] = "fp16"
    # A number: that many replicas. {min, max}: autoscaled (`scaling:`), starting at min;
    # after validation `replicas` is the count wanted now and `autoscale` the range.
    replicas: Annotated[int, Field(ge=0, le=64)] = 1
    autoscale: ReplicaRange | None = None
    scaling: ScalingSpec = Field(default_factory=ScalingSpec)
    # The model this pool serves (the spec's top-level `model` when unset), the other names
    # it answers to (vLLM's --served-model-name), and its LoRA adapters.
    model: str | None = Field(default=None, min_length=1, max_length=512)
    aliases: list[str] = Field(default_factory=list)
    adapters: list[AdapterSpec] = Field(default_factory=list)
    engine: EngineSpec = Field(default_factory=EngineSpec)
    weights: Path | None = Field(
        default=None, description="weights directory; generated if absent for simulator pools"
    )
    weights_size: str = "64MiB"
    cap: Annotated[int, Field(ge=1)] | None = None
    # The engines' API key (vLLM's --api-key): the gateway sends it upstream, never the
    # client's own Authorization. `api_key_env` names an env var holding it instead.
    api_key: str | None = Field(default=None, repr=False)
    api_key_env: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _range(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if "adapters" in data:
            data["adapters"] = _adapters(data["adapters"])
        eng = data.get("engine")
        if "precision" not in data and isinstance(eng, dict):
            # A simulator pool's precision is its profile's unless given: `profile: fp8` alone
            # made an fp16 pool, which the controller never used as its degraded tier (a
            # review of examples/pipeline.yaml's "fp8 fallback").
            if eng.get("kind", "simulator") == "simulator" and eng.get("profile") == "fp8":
                data["precision"] = "fp8"
        r = data.get("replicas")
        if isinstance(r, dict):
            if data.get("autoscale") is not None:
                raise ValueError("give the range as replicas: {min, max} or autoscale, not both")
            # Validated here, so that a mistake is reported once and where it was written
            # (`pools.0.replicas.min`), not under `autoscale`, a key the user never wrote.
            try:
                rng = ReplicaRange.model_validate(r)
            except ValidationError as e:
                raise ValidationError.from_exception_data(
                    e.title,
                    [
                        {
                            "type": err["type"],
                            "loc": ("replicas", *err["loc"]),
                            "input": err["input"],
                            **({"ctx": err["ctx"]} if "ctx" in err else {}),
                        }
                        for err in e.errors()
                    ],
                ) from None
            data["autoscale"] = rng
            data["replicas"] = rng.min
        return data

    @model_validator(mode="after")
    def _within(self) -> PoolSpec:
        a = self.autoscale
        if a is not None and not a.min <= self.replicas <= a.max:
            raise ValueError(f"replicas ({self.replicas}) must lie in [{a.min}, {a.max}]")
        if a is None and self.scaling != ScalingSpec():
            # Autoscaled pools only: on a fixed pool it would be ignored without a word.
            raise ValueError(
                f"scaling: is for autoscaled pools only, and this pool has a fixed size "
                f"(replicas: {self.replicas}): give it a range (replicas: {{min: M, max: N}}) "
                "or drop scaling"
            )
        names = [a.name for a in self.adapters]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"adapter names must be unique: {', '.join(dup)}")
        return self

    @property
    def min_replicas(self) -> int:
        return self.autoscale.min if self.autoscale else self.replicas

    @property
    def max_replicas(self) -> int:
        return self.autoscale.max if self.autoscale else self.replicas

    def model_of(self, spec: PipelineSpec) -> str:
        return self.model or spec.model

    def served_names(self, spec: PipelineSpec) -> list[str]:
        """Every model name this pool answers to: its model, its aliases, its adapters."""
        return [self.model_of(spec), *self.aliases, *(a.name for a in self.adapters)]

    def lora_modules(self, spec: PipelineSpec) -> list[str]:
        """The `--lora-modules` entries of its adapters, as `unbroken up` and the rendered
        manifests both pass them (vLLM and the simulator read the same): `name=path` as
        vLLM's CLI takes it (no path: the name is the path, which vLLM resolves as a Hugging
        Face repository id); vLLM's JSON form, whose `base_model_name` /v1/models shows as
        the adapter's parent, for a `base` other than the pool's model and for a name or
        path with `=` or `,` (vLLM reads `name=path` only without a `,`, split at the first
        `=`). A `base` must be one of the pool's names (ValueError: the spec's validation
        says so too, but a spec edited in code after it is rendered as it stands)."""
        model = self.model_of(spec)
        served = [model, *self.aliases]
        out: list[str] = []
        for i, a in enumerate(self.adapters):
            if a.base is not None and a.base not in served:
                raise ValueError(
                    f"pools.{self.name}.adapters[{i}].base: {a.base!r} is not a name the pool "
                    f"serves ({', '.join(served)})"
                )
            path = a.path or a.name
            plain = not any(c in a.name + path for c in "=,")
            if plain and (a.base is None or a.base == model):
                out.append(f"{a.name}={path}")
                continue
            entry = {"name": a.name, "path": path}
            if a.base is not None and a.base != model:
                entry["base_model_name"] = a.base
            out.append(json.dumps(entry))
        return out


class PipelineSpec(_Spec):
    model: str = "unbroken-sim"
    pools: Annotated[list[PoolSpec], Field(min_length=1)]
    gateway: GatewaySettings = Field(default_factory=GatewaySettings)
    controller: ControllerSettings = Field(default_factory=ControllerSettings)
    agent: AgentSettings = Field(default_factory=AgentSettings)
    tenants: list[TenantSpec] | None = None
    rate_limit: RateLimitSettings = Field(default_factory=RateLimitSettings)

    def gateway_settings(self) -> GatewaySettings:
        """The gateway's settings as every deployment renders them (`unbroken up`, the
        Kubernetes ConfigMap): the gateway section plus the spec-wide parts it enforces
        (tenants, rate-limit store) and the names each pool serves."""
        settings = self.gateway.model_copy(deep=True)
        if self.tenants is not None:
            settings.tenants = [t.model_copy(deep=True) for t in self.tenants]
        if "rate_limit" in self.model_fields_set:
            settings.rate_limit = self.rate_limit.model_copy(deep=True)
        settings.pool_models = {p.name: p.served_names(self) for p in self.pools}
        settings.sleeping_pools = [
            p.name for p in self.pools if p.autoscale is not None and p.autoscale.min == 0
        ]
        settings.adapter_cards = {
            a.name: {"parent": a.base or p.model_of(self), "root": a.path or a.name}
            for p in self.pools
            for a in p.adapters
        }
        return settings

    @model_validator(mode="after")
    def _unique(self) -> PipelineSpec:
        names = [p.name for p in self.pools]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"pool names must be unique: {', '.join(sorted(dup))}")
        if self.tenants is not None:
            check_tenants(self.tenants)
        self._check_served_names()
        for field_name in ("full_pools", "degraded_pools"):
            unknown = [p for p in getattr(self.controller, field_name) if p not in names]
            if unknown:
                raise ValueError(
                    f"controller.{field_name} names unknown pool(s): {', '.join(unknown)}"
                )
        for prio, pools in self.gateway.routes.items():
            unknown = [p for p in pools if p not in names]
            if unknown:
                raise ValueError(
                    f"gateway.routes.{prio} names unknown pool(s): {', '.join(unknown)}"
                )
        self._check_targets()
        return self

    def pool_cap(self, pool: PoolSpec) -> int:
        """A pool's in-flight cap per engine, over every gateway (replica) together: its
        `cap`, else `gateway.default_cap`."""
        return pool.cap if pool.cap is not None else self.gateway.default_cap

    def _check_targets(self) -> None:
        """An autoscaled pool's `scaling.target` must not exceed its cap (the pool's `cap`,
        else `gateway.default_cap`): the gateway never sends a replica more than its cap, so
        demand above the cap waits in the gateway's queue, and a pool sized for more per
        replica than that would leave requests queued with replicas to spare (a review)."""
        for i, p in enumerate(self.pools):
            if p.autoscale is None:
                continue
            cap = self.pool_cap(p)
            if p.scaling.target > cap:
                target = f"{p.scaling.target:g}"
                if "target" not in p.scaling.model_fields_set:
                    target += ", the default"
                where = f"cap ({cap})" if p.cap is not None else f"cap ({cap}, gateway.default_cap)"
                raise ValueError(
                    f"pools.{i} ({p.name}): scaling.target ({target}) exceeds its {where}: "
                    f"a replica never holds more than {cap} streams, so demand over that "
                    "queues in the gateway and the pool would never scale out; set "
                    f"scaling.target to at most {cap}, or raise the cap"
                )

    def _check_served_names(self) -> None:
        """A name (model, alias or adapter) means one model: two pools may both serve it
        (primary and fallback of the same model, e.g. fp16 and fp8 tiers, adapters
        included) only as the same kind of name, since vLLM keeps base names (the model
        and its aliases: --served-model-name) apart from LoRA names, and the gateway routes
        by the name alone. So each name maps to one (kind, base model, adapter path) across
        the pools; a conflict is an error naming the later field (models are taken first,
        then aliases, then adapters). An adapter's `base` is a base name of its own pool."""
        seen: dict[str, tuple[tuple[str, str, str | None], str]] = {}  # name -> meaning, what

        def take(name: str, meaning: tuple[str, str, str | None], what: str, where: str) -> None:
            had, other = seen.setdefault(name, (meaning, what))
            if had == meaning:
                return
            if had[0] == meaning[0] == "adapter" and had[1] == meaning[1]:
                other += f" with another path ({had[2]}, here {meaning[2]})"
            raise ValueError(f"{where}: also {other}; a served name must mean one model")

        models = [(i, p, p.model_of(self)) for i, p in enumerate(self.pools)]
        for i, p, m in models:
            where = f"pools.{i}.model" if p.model else "model"
            take(m, ("base", m, None), f"the model of pool {p.name}", where)
        for i, p, m in models:
            for j, alias in enumerate(p.aliases):
                what = f"an alias of pool {p.name} (model {m})"
                take(alias, ("base", m, None), what, f"pools.{i}.aliases.{j}")
        for i, p, m in models:
            bases = [m, *p.aliases]
            for a in p.adapters:
                where = f"pools.{i}.adapters.{a.name}"
                if a.base is not None and a.base not in bases:
                    raise ValueError(
                        f"{where}.base: {a.base} is not a model pool {p.name} serves (its "
                        f"model or an alias: {', '.join(bases)})"
                    )
                what = f"an adapter of pool {p.name} (base {m})"
                take(a.name, ("adapter", m, a.path or a.name), what, where)  # no path: the name


def default_spec() -> PipelineSpec:
    """Primary fp16 pool of 2 simulated replicas, fallback fp8 pool of 1, one gateway."""
    return PipelineSpec(
        pools=[
            PoolSpec(
                name="primary", precision="fp16", replicas=2, engine=EngineSpec(profile="fp16")
            ),
            PoolSpec(
                name="fallback", precision="fp8", replicas=1, engine=EngineSpec(profile="fp8")
            ),
        ]
    )


def format_errors(e: ValidationError) -> str:
    """A validation error as one line naming each field (`overrides.bogus: Extra inputs are
    not permitted`), as spec errors are shown."""
    lines = []
    for err in e.errors(include_url=False):
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(lines)


def parse_spec(data: Any, source: str = "spec") -> PipelineSpec:
    if not isinstance(data, dict):
        raise SpecError(f"{source}: the top level must be a mapping")
    try:
        return PipelineSpec.model_validate(data)
    except ValidationError as e:
        raise SpecError(f"{source}: {format_errors(e)}") from None


def load_spec(path: Path | None) -> PipelineSpec:
    if path is None:
        return default_spec()
    try:
        with path.open() as f:  # a YAML error's position then names the file
            data = yaml.safe_load(f)
    except OSError as e:
        raise SpecError(f"cannot read {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise SpecError(f"{path}: invalid YAML: {e}") from None
    return parse_spec(data, str(path))
