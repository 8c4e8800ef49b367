"""Every message between the gateway's processes, typed once for both sides.

The main process (`_main`) and each worker (`_worker`) talk over a Unix socket pair in
newline-delimited JSON objects, each tagged by `"t"`; `encode`/`decode` are the one codec.
A key written on one side and read by string on the other used to be free to drift (the
state's `cap_ov`); here both sides name the same TypedDict, and the endpoint part of the
state is written by `endpoint_state` and read back by `apply_endpoint`, side by side.

    main → worker   StateMsg (endpoints, caps, routes), MetricsAsk (send your exposition),
                    AggrMsg (the merged /metrics it asked for), RebalanceMsg, DrainMsg
                    (with, at a reload, the new workers' handover sockets), ForceMsg,
                    ModelsMsg (the engines' models were read again: the state before it has
                    them)
    worker → main   UpMsg (serving), AckMsg (applied a state), SuspectMsg (an endpoint
                    hung), MetricsMsg, AggrAsk (a /metrics scrape landed here), HandedMsg
                    (a stream went out to, or came in from, another worker), ModelsAsk (a
                    request named a model no endpoint is known to serve: read them again)

Also here: `WorkerSpec`, what a worker is started with (its environment), and `StreamState`,
what a stream handed to another worker at a reload carries (`_handover`, `StreamRelay.
snapshot`/`restore`)."""

from __future__ import annotations

from typing import Any, Literal, NotRequired, TypedDict

import orjson

from unbroken.gateway._adapters import LoraInfo
from unbroken.gateway._pool import Endpoint, Pool, State

__all__ = [
    "SNAPSHOT_VERSION",
    "AckMsg",
    "AggrAsk",
    "AggrMsg",
    "DrainMsg",
    "EndpointState",
    "ForceMsg",
    "HandedMsg",
    "MetricsAsk",
    "MetricsMsg",
    "ModelsAsk",
    "ModelsMsg",
    "RebalanceMsg",
    "StateMsg",
    "StreamState",
    "SuspectMsg",
    "ToMain",
    "ToWorker",
    "TrackerState",
    "UpMsg",
    "WorkerSpec",
    "apply_endpoint",
    "decode",
    "encode",
    "endpoint_state",
    "state_message",
]

SNAPSHOT_VERSION = 1  # of `StreamState`: a worker refuses a stream in another format


# -- main → worker ------------------------------------------------------------------------------
class EndpointState(TypedDict):
    """One endpoint as the main process sees it (its prober, the admin API, discovery)."""

    name: str
    col: int  # its column in the shared admission table
    url: str
    pool: str
    cap: int | None
    cap_ov: int | None
    condition: str
    condition_since: float
    state: str
    healthy: bool
    down: bool
    models: list[str]
    error: str | None
    error_at: float | None  # when (time.time)
    waiting: float
    running: float
    foreign: float
    kv: float
    progress_at: float
    adapters: dict[str, str]  # adapter affinity (`_adapters`) needs what the prober learned
    lora: dict[str, Any] | None
    warmup_s: float | None  # seeds the learned non-streaming answer limit
    fingerprint: NotRequired[str | None]  # the engine's system_fingerprint (`Endpoint.fingerprint`)
    deadline: float | None  # seconds left of its drain, when draining


class StateMsg(TypedDict):
    t: Literal["state"]
    seq: int
    default_cap: int
    routes: dict[str, list[str]]
    routes_override: dict[str, list[str]]
    pool_order: list[str]
    closing: str | None
    replicas: list[int]  # [gateway replicas sharing the tenants' limits, this one's rank]
    endpoints: list[EndpointState]


class MetricsAsk(TypedDict):
    t: Literal["metrics"]
    id: int


class AggrMsg(TypedDict):
    t: Literal["aggr"]
    id: int
    text: str


class RebalanceMsg(TypedDict):
    t: Literal["rebalance"]
    endpoint: str
    priorities: list[str]
    batch: int | None
    every_s: float


class DrainMsg(TypedDict):
    t: Literal["drain"]
    timeout: float
    why: str
    handover: NotRequired[list[str]]  # at a reload: the new workers' handover sockets


class ForceMsg(TypedDict):
    t: Literal["force"]


class ModelsMsg(TypedDict):
    t: Literal["models"]
    id: int


ToWorker = StateMsg | MetricsAsk | AggrMsg | RebalanceMsg | DrainMsg | ForceMsg | ModelsMsg


# -- worker → main ------------------------------------------------------------------------------
class UpMsg(TypedDict):
    t: Literal["up"]
    pid: int


class AckMsg(TypedDict):
    t: Literal["ack"]
    seq: int


class SuspectMsg(TypedDict):
    t: Literal["suspect"]
    name: str
    why: NotRequired[str | None]  # the failure that made it a suspect (its `last_error`)


class MetricsMsg(TypedDict):
    t: Literal["metrics"]
    id: int  # -1: its last word before exiting
    text: str


class AggrAsk(TypedDict):
    t: Literal["aggr?"]
    id: int


class HandedMsg(TypedDict):
    t: Literal["handed"]
    dir: Literal["in", "out"]


class ModelsAsk(TypedDict):
    t: Literal["models?"]
    id: int


ToMain = UpMsg | AckMsg | SuspectMsg | MetricsMsg | AggrAsk | HandedMsg | ModelsAsk


def encode(msg: ToWorker | ToMain) -> bytes:
    """One line of the control socket."""
    return orjson.dumps(msg) + b"\n"


def decode(line: bytes) -> Any:
    """A line read back; the receiver narrows it to its side's union by `"t"`."""
    return orjson.loads(line)


# -- the endpoint state, written and read side by side ----------------------------------------
def endpoint_state(ep: Endpoint, now: float) -> EndpointState:
    """`ep` as the workers need it (`now`: monotonic, for what is left of its drain)."""
    return {
        "name": ep.name,
        "col": ep.slot.col,  # type: ignore[attr-defined]
        "url": ep.url,
        "pool": ep.pool,
        "cap": ep.cap,
        "cap_ov": ep.cap_override,
        "condition": ep.condition,
        "condition_since": ep.condition_since,
        "state": str(ep.state),
        "healthy": ep.healthy,
        "down": ep.down,
        "models": sorted(ep.models),
        "error": ep.last_error,
        "error_at": ep.last_error_at,
        "waiting": ep.waiting,
        "running": ep.running,
        "foreign": ep.foreign,
        "kv": ep.kv_usage,
        "progress_at": ep.progress_at,
        "adapters": ep.adapters,
        "lora": None if ep.lora is None else ep.lora.as_dict(),
        "warmup_s": ep.warmup_s,
        "fingerprint": ep.fingerprint,
        "deadline": None
        if ep.state != State.DRAINING or ep.drain_deadline is None
        else max(0.0, ep.drain_deadline - now),
    }


def apply_endpoint(ep: Endpoint, d: EndpointState) -> None:
    """What `endpoint_state` wrote, onto a worker's copy of the endpoint (the drain deadline
    and the shared column are the worker's to act on)."""
    ep.url, ep.pool, ep.cap, ep.cap_override = d["url"], d["pool"], d["cap"], d["cap_ov"]
    ep.condition, ep.condition_since = d["condition"], d["condition_since"]
    ep.healthy, ep.models, ep.last_error = d["healthy"], set(d["models"]), d["error"]
    ep.down = d.get("down", False)  # a main process of an older version sends none
    ep.last_error_at = d.get("error_at")
    ep.waiting, ep.running, ep.kv_usage = d["waiting"], d["running"], d["kv"]
    ep.foreign = d.get("foreign", 0.0)  # a main process of an older version sends none
    ep.progress_at = d.get("progress_at", 0.0)
    ep.adapters = d.get("adapters") or {}
    ep.lora = LoraInfo.from_dict(d["lora"]) if d.get("lora") else None
    ep.warmup_s = d.get("warmup_s")
    if d.get("fingerprint") is not None and ep.fingerprint is None:
        # The main process's is its warm-up's; one this worker's streams read since wins.
        ep.fingerprint = d["fingerprint"]
    ep.set_state(State(d["state"]))


def state_message(
    pool: Pool, seq: int, closing: str | None, replicas: list[int], now: float
) -> StateMsg:
    """The whole state the workers serve from (`_main_gateway.MainGateway.snapshot`)."""
    return {
        "t": "state",
        "seq": seq,
        "default_cap": pool.default_cap,
        "routes": pool.routes,
        "routes_override": pool.routes_override,
        "pool_order": pool.pool_order,
        "closing": closing,
        "replicas": replicas,
        "endpoints": [endpoint_state(e, now) for e in pool.endpoints.values()],
    }


# -- how a worker is started ------------------------------------------------------------------
class TenantTableSpec(TypedDict):
    path: str
    slots: dict[str, int]  # each tenant's slot in the shared table, by name


class WorkerSpec(TypedDict):
    """A worker's start (`UNBROKEN_GW_WORKER`, JSON): where the shared state lives, its row
    in the shared tables, the inherited descriptors."""

    cfg: str  # the settings file (this generation's)
    shm: str  # the shared admission table
    prefix: str | None  # the shared prefix index
    tenants: TenantTableSpec | None
    row: int
    ctl_fd: int
    listen_fd: int
    log_level: int
    main_pid: int
    shutdown_timeout: float
    handover: str  # its own handover socket


# -- a stream handed to another worker (`_handover`) ------------------------------------------
class TrackerState(TypedDict):
    id: str | None
    created: int | None
    model: str | None
    texts: dict[str, str]  # per choice index (a JSON key is a string)
    finish: dict[str, Any]
    role_sent: list[int]
    token_events: int


class StreamState(TypedDict):
    """All a stream needs to go on in another process but its body's bytes (they travel
    beside it): `StreamRelay.snapshot` writes it, `StreamRelay.restore` reads it."""

    path: str
    chat: bool
    model: str
    priority: str
    headers: dict[str, str]
    t0: float  # CLOCK_MONOTONIC: the same clock in every process of the host
    weight: int
    augmented: bool
    wants: list[bool]
    migrations: int
    failed: list[str]
    sent: int
    exact: bool
    prompt_tokens: int | None
    prompt_ids: list[int] | None
    gen_ids: list[int]
    ids_ok: bool
    split_back: int
    legs: int
    gaps: int
    gap_max: float
    last_token: float
    pool: str | None
    tracker: TrackerState


class LeaseState(TypedDict):
    """A tenant's stream as its limits count it: the tokens charged so far (the new worker
    charges only what comes after) and whether the shared store counts it."""

    tenant: str
    prompt: int
    completion: int
    remote: bool


class HandoverState(StreamState):
    """What goes over the handover socket: the stream's state, its format's version, and
    whether the client's response closes the connection; `lease`, its tenant's count (absent
    without tenants, or from a worker of before it was carried)."""

    v: int
    close: bool
    lease: NotRequired[LeaseState | None]
