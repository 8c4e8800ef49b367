"""The Kubernetes objects of a pipeline, as plain dicts, one builder per component.

Numbers that depend on each other are computed here, never typed in twice: the engine's
`terminationGracePeriodSeconds` follows `grace_period()`, the preStop drain's deadline is the
gateway's drain deadline, the gateway's per-engine caps follow the pool caps.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import secrets
import shlex
from dataclasses import dataclass, replace
from typing import Any

import yaml

from unbroken.config.spec import LIVENESS_FAILURES, PipelineSpec, PoolSpec
from unbroken.k8s.autoscale import (
    adapter_rules,
    autoscaled,
    drain_deadline,
    horizontal_pod_autoscaler,
    scaled_object,
)
from unbroken.k8s.monitoring import dashboard, prometheus_rule

__all__ = [
    "AGENT_CAPABILITIES",
    "GRACE_MARGIN_S",
    "HOOK_MARGIN_S",
    "MIN_VLLM",
    "RenderOptions",
    "build",
    "grace_period",
]

Obj = dict[str, Any]

# The preStop drain returns this long after the drain deadline at the latest: the streams
# still there at the deadline are migrated (continuation requests to other engines) and the
# gateway drops the endpoint once they have left, which takes well under a second; the rest
# covers the hook's 0.25 s polling and exec start-up.
HOOK_MARGIN_S = 5
# Kubelet and runtime latency between the end of the preStop hook and SIGTERM, and between
# the engine's exit and the pod's end.
GRACE_MARGIN_S = 10
GATEWAY_PRESTOP_S = 5  # the gateway's preStop sleep: the Service drops the pod before SIGTERM

# The agent's capabilities, each for a reason (see docs/kubernetes.md):
#   BPF         load programs, create maps (bpf(2) without CAP_SYS_ADMIN, kernel >= 5.8)
#   PERFMON     tracing programs, perf_event_open for uprobes and tp_btf (kernel >= 5.8)
#   SYS_PTRACE  read /proc/PID/maps and open /proc/PID/root/... of the engine processes,
#               which run as root with more capabilities than the agent (ptrace access
#               check, PTRACE_MODE_READ_FSCREDS), and /proc/PID/fd for the socket owners
# Not SYS_ADMIN, not privileged. Kernels before 5.11 also need SYS_RESOURCE (maps were
# charged to RLIMIT_MEMLOCK before memcg accounting): RenderOptions.agent_old_kernel.
AGENT_CAPABILITIES = ("BPF", "PERFMON", "SYS_PTRACE")

ENGINE_PORT = 8000
GATEWAY_PORT = 8080
ADMIN_PORT = 8081
CONTROLLER_PORT = 8082
AGENT_PORT = 9101
HOOKS_DIR = "/opt/unbroken"
MODELS_DIR = "/models"
# The PodMonitors' scrape interval; KEDA polls the demand signal no faster (it would read the
# same sample again).
SCRAPE_S = 5
# The oldest vLLM whose `serve` takes every flag the engines get (`--shutdown-timeout` is
# the newest of them; 0.11.0 exits 2 on it).
MIN_VLLM = "0.32.0"
# DNS-1123 label: namespaces; Service names are DNS-1035 labels (a letter first).
DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
LABEL_MAX = 63
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


@dataclass(frozen=True)
class RenderOptions:
    namespace: str = "unbroken"
    image: str = "ghcr.io/unbroken-dev/unbroken:0.1.0"
    agent_image: str = "ghcr.io/unbroken-dev/unbroken-agent:0.1.0"
    vllm_image: str = f"vllm/vllm-openai:v{MIN_VLLM}"
    engine: str = "vllm"  # or "simulator": the same objects without GPUs (kind, k3s, CI)
    gateway_replicas: int = 2
    gpu_resource: str = "nvidia.com/gpu"
    gpus_per_engine: int = 1
    model_cache_size: str = "200Gi"
    ready_budget_ms: int = 5000
    agent_old_kernel: bool = False
    admin_token: str | None = None  # None: a fresh random token per render
    prefix: str = "unbroken"
    # Pools with a replica range: "keda" (a ScaledObject each), "hpa" (an autoscaling/v2
    # HorizontalPodAutoscaler on prometheus-adapter's External metric) or "none" (fixed).
    autoscaler: str = "keda"
    # Where KEDA's Prometheus trigger reads the demand signal: the Prometheus Operator's
    # `prometheus-operated` Service in the namespace Prometheus runs in.
    prometheus_url: str = "http://prometheus-operated.monitoring.svc:9090"
    # Extra labels on the PodMonitors and the PrometheusRule, for a Prometheus that selects
    # them by label (kube-prometheus-stack: `release: <its release name>`).
    monitor_labels: tuple[tuple[str, str], ...] = ()
    # The engine pods' RuntimeClass, where the GPU runtime is not the node's default (stock
    # k3s keeps runc and registers `nvidia`); None: the default runtime.
    runtime_class: str | None = None

    @property
    def agent_ns(self) -> str:
        """The agent's own namespace: it alone needs more than the "baseline" pod security
        level (hostPID, capabilities), and pod security levels are set per namespace."""
        return f"{self.namespace}-agent"


def grace_period(drain_deadline_s: float, shutdown_timeout_s: float) -> int:
    """terminationGracePeriodSeconds of an engine pod: the preStop drain (deadline plus the
    migration margin), then the engine's own shutdown after SIGTERM, plus kubelet latency."""
    return math.ceil(drain_deadline_s + HOOK_MARGIN_S + shutdown_timeout_s + GRACE_MARGIN_S)


def _meta(o: RenderOptions, name: str, component: str, **extra: str) -> Obj:
    return {
        "name": name,
        "namespace": o.agent_ns if component == "agent" else o.namespace,
        "labels": {
            "app.kubernetes.io/name": "unbroken",
            "app.kubernetes.io/part-of": o.prefix,
            "app.kubernetes.io/component": component,
            **extra,
        },
    }


def _selector(o: RenderOptions, component: str, **extra: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/part-of": o.prefix,
        "app.kubernetes.io/component": component,
        **extra,
    }


def _env_pod() -> list[Obj]:
    return [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    ]


def _secret_env(name: str, secret: str, key: str) -> Obj:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def _env_token(o: RenderOptions) -> Obj:
    return _secret_env("UNBROKEN_ADMIN_TOKEN", f"{o.prefix}-admin-token", "token")


def _secret(meta: Obj, data: dict[str, str]) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": meta,
        "type": "Opaque",
        "stringData": data,
    }


def _restricted(read_only: bool = True) -> Obj:
    return {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": read_only,
        "capabilities": {"drop": ["ALL"]},
    }


def _http_probe(path: str, port: int | str, period: int, failures: int, timeout: int = 2) -> Obj:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": timeout,
    }


def _admin_host(o: RenderOptions) -> str:
    return f"{o.prefix}-gateway-admin.{o.namespace}.svc:{ADMIN_PORT}"


def _checksum(*parts: str) -> str:
    """A pod template annotation over what the pods read from ConfigMaps and Secrets at start
    (env, mounted files): `kubectl apply` of a changed value changes the template, so the
    Deployment rolls its pods, which would otherwise keep the old value."""
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def upstream_key_var(pool: str) -> str:
    """The gateway's variable carrying a pool's upstream API key (`upstream_key_env`), as
    `unbroken up` names it."""
    return "UNBROKEN_POOL_KEY_" + pool.upper().replace("-", "_")


def pool_secret_name(o: RenderOptions, pool: PoolSpec) -> str:
    return f"{o.prefix}-{pool.name}-engine"


# -- engines ---------------------------------------------------------------------------------
def _model_args(spec: PipelineSpec, pool: PoolSpec) -> list[str]:
    """The names the pool answers to and its LoRA adapters, in vLLM's flags (the simulator
    takes the same ones): the first served name is the one responses carry."""
    args = ["--served-model-name", pool.model_of(spec), *pool.aliases]
    if pool.adapters:
        # Every adapter may run in one batch (as `unbroken up` starts them; vLLM's default of
        # 1 would make requests of different adapters wait for each other); --max-lora-rank
        # stays at vLLM's default (16).
        args += ["--enable-lora", "--max-loras", str(len(pool.adapters)), "--lora-modules"]
        args += pool.lora_modules(spec)
    return args


def _flag_groups(tokens: list[str]) -> list[tuple[str, list[str]]]:
    """`--flag value...` groups of a command line (`--flag=value` split, `_` as `-`, as vLLM's
    parser reads them)."""
    groups: list[tuple[str, list[str]]] = []
    for t in tokens:
        if t.startswith("-") and not re.fullmatch(r"-[0-9.]+(e-?[0-9]+)?", t):
            flag, eq, value = t.partition("=")
            flag = flag.replace("_", "-") if flag.startswith("--") else flag
            groups.append((flag, [value] if eq else []))
        else:
            groups[-1][1].append(t)
    return groups


# Flags the render sets from other spec fields: a pool's command may carry them only with the
# render's own values (`--served-model-name {model}`), else the field named is the place.
RENDERED_FLAGS = {
    "--served-model-name": "model and aliases",
    "--enable-lora": "adapters",
    "--max-loras": "adapters",
    "--lora-modules": "adapters",
    "--quantization": "precision",
    "--max-num-seqs": "engine.overrides.max_num_seqs",
    "--max-model-len": "engine.overrides.max_model_len",
    "--shutdown-timeout": "engine.shutdown_timeout_s",
    "--api-key": "api_key or api_key_env",
}
# The pod's own: every address, ENGINE_PORT (the Service, the probes and the hooks use it).
POD_FLAGS = ("--host", "--port")
# Their product is the GPUs one engine pod needs.
GPU_FLAGS = (
    "--tensor-parallel-size",
    "-tp",
    "--pipeline-parallel-size",
    "-pp",
    "--data-parallel-size",
    "-dp",
)


def _command(spec: PipelineSpec, pool: PoolSpec) -> tuple[str, list[tuple[str, list[str]]]]:
    """A `kind: command` pool's `vllm serve MODEL [FLAG...]`: its model and its flags, with
    `{port}`, `{host}` and `{model}` substituted as `unbroken up` does. Anything else cannot
    run in the vLLM image the way the render runs it, so it is refused."""
    field = f"pools.{pool.name}.engine.command"
    cmd = pool.engine.command or []
    subst = {"port": str(ENGINE_PORT), "host": "0.0.0.0", "model": pool.model_of(spec)}
    try:
        argv = [part.format(**subst) for part in cmd]
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(
            f"{field}: cannot substitute {e} (only {{port}}, {{host}}, {{model}})"
        ) from None
    if len(argv) < 3 or argv[0].rsplit("/", 1)[-1] != "vllm" or argv[1] != "serve":
        raise ValueError(
            f"{field}: only `vllm serve MODEL [FLAG...]` renders for Kubernetes (the engine "
            f"container runs the vLLM image's `vllm`), not {' '.join(cmd[:3])!r}"
        )
    if argv[2].startswith("-") or (len(argv) > 3 and not argv[3].startswith("-")):
        raise ValueError(f"{field}: give one model first: `vllm serve MODEL [FLAG...]`")
    return argv[2], _flag_groups(argv[3:])


def _own_args(spec: PipelineSpec, pool: PoolSpec) -> list[str]:
    """The flags the render sets from the pool's fields (besides the model, host and port)."""
    e = pool.engine
    args = _model_args(spec, pool)
    if pool.precision == "fp8":
        args += ["--quantization", "fp8"]
    args += ["--max-num-seqs", str(e.overrides.max_num_seqs or 256)]
    if e.overrides.max_model_len is not None:
        args += ["--max-model-len", str(e.overrides.max_model_len)]
    args += ["--shutdown-timeout", str(math.ceil(e.shutdown_timeout_s))]
    return args


def _engine_args(spec: PipelineSpec, pool: PoolSpec, gpus: int) -> tuple[list[str], int]:
    """vLLM's own flags from the pool, and the GPUs one engine needs. The pool's simulator
    overrides map onto the vLLM flags of the same name; a `kind: command` pool adds its own
    flags, its parallel sizes setting the GPU count."""
    model = str(pool.weights) if pool.weights else pool.model_of(spec)
    own = _own_args(spec, pool)
    extra: list[str] = []
    if pool.engine.kind == "command":
        model, groups = _command(spec, pool)
        mine = dict(_flag_groups(own))
        sizes = []
        for flag, values in groups:
            if flag in POD_FLAGS:
                continue
            if flag in RENDERED_FLAGS:
                if mine.get(flag) != values:
                    raise ValueError(
                        f"pools.{pool.name}.engine.command: {flag} {' '.join(values)} differs "
                        f"from what the render sets from the pool's {RENDERED_FLAGS[flag]} "
                        f"({' '.join(mine.get(flag, ['(none)']))}): set it there"
                    )
                continue
            if flag in GPU_FLAGS:
                if len(values) != 1 or not values[0].isdigit():
                    raise ValueError(f"pools.{pool.name}.engine.command: {flag} needs a number")
                sizes.append(int(values[0]))
            extra += [flag, *values]
        if sizes:
            gpus = math.prod(sizes)
    return ["serve", model, "--host", "0.0.0.0", "--port", str(ENGINE_PORT), *own, *extra], gpus


def _simulator_args(spec: PipelineSpec, pool: PoolSpec) -> list[str]:
    e = pool.engine
    return [
        "engine",
        "--host",
        "0.0.0.0",
        "--port",
        str(ENGINE_PORT),
        *_model_args(spec, pool),
        "--profile",
        e.profile,
        "--seed",
        str(e.seed),
        "--weights",
        f"{MODELS_DIR}/{pool.name}",
        "--shutdown-timeout",
        str(e.shutdown_timeout_s),
        "--no-cuda-stub",
        *e.overrides.args(),
    ]


# Variables the render itself sets in the engine container.
ENGINE_ENV = ("POD_NAME", "POD_NAMESPACE", "UNBROKEN_ADMIN_TOKEN", "HF_HOME", "VLLM_API_KEY")
ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")


def _weights_path(model: str) -> str:
    """Where vLLM reads a model from: a path as given, a Hugging Face id from its folder in
    the hub cache under HF_HOME (`models--ORG--NAME`)."""
    if model.startswith("/"):
        return model
    return f"{MODELS_DIR}/hf/hub/models--{model.replace('/', '--')}"


def pool_key(pool: PoolSpec) -> str | None:
    """The engines' API key: `api_key`, or the variable `api_key_env` names, read where the
    render runs (as `unbroken up` reads it where it runs); it goes into a Secret."""
    if pool.api_key:
        return pool.api_key
    if pool.api_key_env:
        key = os.environ.get(pool.api_key_env)
        if not key:
            raise ValueError(
                f"pools.{pool.name}.api_key_env: {pool.api_key_env} is not set where the render "
                "runs (its value goes into the pool's Secret)"
            )
        return key
    return None


def pool_secret_data(pool: PoolSpec) -> dict[str, str]:
    """The pool's Secret: its API key (`api-key`) and its `engine.env` (`env.NAME`), which may
    hold tokens (HF_TOKEN): never in the Deployment itself."""
    data = {f"env.{k}": v for k, v in pool.engine.env.items()}
    for name in pool.engine.env:
        if name in ENGINE_ENV or not ENV_NAME.match(name):
            why = "set by the render" if name in ENGINE_ENV else "not a valid variable name"
            raise ValueError(f"pools.{pool.name}.engine.env.{name}: {why}")
    if (key := pool_key(pool)) is not None:
        data["api-key"] = key
    return data


def engine_objects(spec: PipelineSpec, pool: PoolSpec, o: RenderOptions) -> list[Obj]:
    name = f"{o.prefix}-{pool.name}"
    sim = o.engine == "simulator"
    scaled = autoscaled(pool, o.autoscaler)
    drain_s = drain_deadline(spec, pool)
    grace = grace_period(drain_s, pool.engine.shutdown_timeout_s)
    hook = ["python3", f"{HOOKS_DIR}/hooks.py"]
    pool_labels = {"unbroken.dev/pool": pool.name}
    # The init container only reads ahead what the engine will read: a shortfall in
    # residency (a cache smaller than the weights) must not keep the engine from starting,
    # hence `--target 0` and a failed read only logged.
    best_effort = "|| echo 'pre-warm incomplete: the engine reads the rest itself'"
    if sim:
        weights = f"{MODELS_DIR}/{pool.name}"
        prewarm = (
            f"[ -d {weights} ] || unbroken weights make {weights} --size {pool.weights_size} "
            f"|| exit 1; unbroken prewarm --target 0 {weights} {best_effort}"
        )
        gpus = 0
    else:
        args, gpus = _engine_args(spec, pool, o.gpus_per_engine)
        # This pool's own files only (the cache is shared by every pool): its weights
        # directory, else its model's folder in the Hugging Face cache (HF_HOME below). On a
        # first start the folder is not there yet and vLLM downloads the weights.
        path = shlex.quote(_weights_path(args[1]))
        prewarm = (
            f"if [ -e {path} ]; then unbroken prewarm --target 0 {path} {best_effort}; "
            f"else echo 'no weights at '{path}' yet: vLLM downloads them'; fi"
        )
    memory = "1Gi" if sim else "64Gi"  # the engine container's limit
    init_sc = {**_restricted(), "runAsNonRoot": True, "runAsUser": 10001}
    init = [
        {
            "name": "hooks",
            "image": o.image,
            "command": ["python3", "-m", "unbroken.k8s.hooks", "install", HOOKS_DIR],
            "volumeMounts": [{"name": "hooks", "mountPath": HOOKS_DIR}],
            "resources": {
                "requests": {"cpu": "50m", "memory": "64Mi"},
                "limits": {"memory": "128Mi"},
            },
            "securityContext": init_sc,
        },
        {
            "name": "prewarm",
            "image": o.image,
            "command": ["sh", "-c", prewarm],
            "volumeMounts": [{"name": "model-cache", "mountPath": MODELS_DIR}],
            # Page-cache pages count against the cgroup's memory limit: under a 2Gi limit
            # only the last 2 GiB read stayed resident. The engine's own limit keeps what it
            # would keep (the request, what the scheduler counts, stays small).
            "resources": {
                "requests": {"cpu": "1", "memory": "512Mi"},
                "limits": {"memory": "2Gi" if sim else memory},
            },
            "securityContext": init_sc,
        },
    ]
    ready_cmd = [*hook, "ready", "--url", f"http://127.0.0.1:{ENGINE_PORT}"]
    # The pool's own model: /v1/models also lists aliases and adapters, and the warm-up is
    # for the base model.
    ready_cmd += ["--budget-ms", str(o.ready_budget_ms), "--model", pool.model_of(spec)]
    secret = pool_secret_data(pool)
    env = [*_env_pod(), _env_token(o), {"name": "HF_HOME", "value": f"{MODELS_DIR}/hf"}]
    env += [_secret_env(k[4:], pool_secret_name(o, pool), k) for k in secret if k != "api-key"]
    if "api-key" in secret:
        # vLLM's --api-key without the key on its command line (`ps`, the pod spec).
        env.append(_secret_env("VLLM_API_KEY", pool_secret_name(o, pool), "api-key"))
        ready_cmd += ["--api-key-env", "VLLM_API_KEY"]
    drain_cmd = [*hook, "drain", "--admin", _admin_host(o), "--every-address"]
    drain_cmd += ["--deadline", f"{drain_s:g}", "--timeout", f"{drain_s + HOOK_MARGIN_S:g}"]
    container: Obj = {
        "name": "engine",
        "image": o.image if sim else o.vllm_image,
        "ports": [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}],
        "env": env,
        "volumeMounts": [
            {"name": "hooks", "mountPath": HOOKS_DIR, "readOnly": True},
            {"name": "model-cache", "mountPath": MODELS_DIR},
            {"name": "dshm", "mountPath": "/dev/shm"},
        ],
        # Model loading and CUDA graph capture take minutes: the startup probe holds the
        # liveness probe off until /health answers, for at least 30 min, or the pool's
        # `engine.health_timeout_s` where that is longer (a large model on slow storage).
        "startupProbe": _http_probe(
            "/health", "http", 10, max(180, math.ceil(pool.engine.health_timeout_s / 10))
        ),
        "readinessProbe": {
            "exec": {"command": ready_cmd},
            "periodSeconds": 10,
            "timeoutSeconds": math.ceil(o.ready_budget_ms / 1000) + 10,
            "failureThreshold": 2,
            "successThreshold": 1,
        },
        # The supervisor's own check under `unbroken up` has the same numbers.
        "livenessProbe": _http_probe(
            "/health",
            "http",
            pool.engine.liveness_period_s,
            LIVENESS_FAILURES,
            timeout=pool.engine.liveness_timeout_s,
        ),
        "lifecycle": {"preStop": {"exec": {"command": drain_cmd}}},
        "securityContext": _restricted(read_only=False),
    }
    if sim:
        container["command"] = ["unbroken"]
        container["args"] = _simulator_args(spec, pool)
        container["resources"] = {
            "requests": {"cpu": "500m", "memory": "512Mi"},
            "limits": {"memory": "1Gi"},
        }
        container["securityContext"] = {**_restricted(), "runAsNonRoot": True, "runAsUser": 10001}
    else:
        container["command"] = ["vllm"]
        container["args"] = args
        container["resources"] = {
            "requests": {"cpu": "4", "memory": "32Gi", o.gpu_resource: str(gpus)},
            "limits": {"memory": memory, o.gpu_resource: str(gpus)},
        }
    volumes: list[Obj] = [
        {"name": "hooks", "emptyDir": {"sizeLimit": "16Mi"}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi" if sim else "16Gi"}},
    ]
    if sim:
        volumes.append({"name": "model-cache", "emptyDir": {"sizeLimit": "4Gi"}})
        volumes.append({"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}})
        container["volumeMounts"].append({"name": "tmp", "mountPath": "/tmp"})
    else:
        volumes.append(
            {
                "name": "model-cache",
                "persistentVolumeClaim": {"claimName": f"{o.prefix}-model-cache"},
            }
        )
    pod_spec: Obj = {
        "terminationGracePeriodSeconds": grace,
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
        "enableServiceLinks": False,
        "initContainers": init,
        "containers": [container],
        "volumes": volumes,
    }
    if sim:
        pod_spec["securityContext"] |= {"runAsNonRoot": True, "runAsUser": 10001, "fsGroup": 10001}
    else:
        pod_spec["tolerations"] = [
            {"key": o.gpu_resource, "operator": "Exists", "effect": "NoSchedule"}
        ]
        if o.runtime_class:
            pod_spec["runtimeClassName"] = o.runtime_class
    deployment: Obj = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            **_meta(o, name, "engine", **pool_labels),
            "annotations": {
                "unbroken.dev/grace-rule": (
                    f"{drain_s:g} s drain + {HOOK_MARGIN_S} s migration + "
                    f"{pool.engine.shutdown_timeout_s:g} s engine shutdown + "
                    f"{GRACE_MARGIN_S} s margin, rounded up = {grace} s"
                ),
                "unbroken.dev/precision": pool.precision,
            },
        },
        "spec": {
            "replicas": pool.replicas,
            "selector": {"matchLabels": _selector(o, "engine", **pool_labels)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "template": {
                "metadata": {
                    "labels": {**_meta(o, name, "engine", **pool_labels)["labels"]},
                    # The token its preStop drains with, its key and env.
                    "annotations": {
                        "checksum/config": _checksum(o.admin_token or "", json.dumps(secret))
                    },
                },
                "spec": pod_spec,
            },
        },
    }
    service: Obj = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(o, name, "engine", **pool_labels),
        "spec": {
            "selector": _selector(o, "engine", **pool_labels),
            "ports": [{"name": "http", "port": ENGINE_PORT, "targetPort": "http"}],
        },
    }
    objs = [deployment, service]
    if secret:
        objs.insert(
            0, _secret(_meta(o, pool_secret_name(o, pool), "engine", **pool_labels), secret)
        )
    if pool.autoscale is not None:
        a = pool.autoscale
        notes = deployment["metadata"]["annotations"]
        if scaled:
            # No `replicas`: the autoscaler owns the count. With it, every `kubectl apply`
            # would set the pool back to one number (scaling a grown pool in, through drains,
            # until the autoscaler grows it again); without it, apply leaves the field to
            # whoever set it last, and a new Deployment starts at 1 until the autoscaler acts.
            del deployment["spec"]["replicas"]
            low = a.min if o.autoscaler == "keda" else max(1, a.min)  # an HPA cannot sleep
            notes["unbroken.dev/replicas"] = f"{low}-{a.max}, set by {o.autoscaler}"
            meta = _meta(o, name, "engine", **pool_labels)
            if o.autoscaler == "keda":
                objs.append(
                    scaled_object(
                        meta,
                        spec,
                        pool,
                        target=name,
                        namespace=o.namespace,
                        prometheus_url=o.prometheus_url,
                        scrape_s=SCRAPE_S,
                    )
                )
            else:
                objs.append(horizontal_pod_autoscaler(meta, pool, target=name))
        else:
            # Nothing scales it: a fixed count, at least 1 (nothing would wake a pool of 0).
            deployment["spec"]["replicas"] = max(1, pool.replicas)
            notes["unbroken.dev/replicas"] = f"{a.min}-{a.max}, not autoscaled (autoscaler none)"
    return objs


def model_cache(o: RenderOptions) -> Obj:
    """Shared by every engine pod: ReadWriteMany, since a surge pod may land on another node
    while the old one still runs."""
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _meta(o, f"{o.prefix}-model-cache", "engine"),
        "spec": {
            "accessModes": ["ReadWriteMany"],
            "resources": {"requests": {"storage": o.model_cache_size}},
        },
    }


# -- gateway ---------------------------------------------------------------------------------
def gateway_objects(spec: PipelineSpec, o: RenderOptions) -> list[Obj]:
    name = f"{o.prefix}-gateway"
    settings = spec.gateway_settings().model_dump(mode="json")
    settings |= {"host": "0.0.0.0", "port": GATEWAY_PORT}
    settings |= {"admin_host": "0.0.0.0", "admin_port": ADMIN_PORT}
    # X-Unbroken-Endpoint names internal pods: a debugging aid locally, a leak on a cluster.
    settings |= {"endpoint_header": False}
    # Each pool's engine API key, from the pool's Secret into a variable the gateway reads
    # (`upstream_key_env`), never into its settings.
    keys = {p.name: k for p in spec.pools if (k := pool_key(p)) is not None}
    keyed = [p for p in spec.pools if p.name in keys]
    keys_env = [
        _secret_env(upstream_key_var(p.name), pool_secret_name(o, p), "api-key") for p in keyed
    ]
    settings["upstream_key_env"] |= {p.name: upstream_key_var(p.name) for p in keyed}
    args = ["gateway", "--config", "/etc/unbroken/gateway.yaml"]
    for pool in spec.pools:
        args += ["--k8s-service", f"{pool.name}={o.namespace}/{o.prefix}-{pool.name}:http"]
        args += ["--pool-cap", f"{pool.name}={spec.pool_cap(pool)}"]
    args += ["--k8s-peers", f"{o.namespace}/{o.prefix}-gateway-admin:admin"]
    # On SIGTERM open streams may finish for the drain deadline (else the CLI's 30 s, which
    # a shorter drain_deadline_s left past the grace period: SIGKILL mid-drain, the clients'
    # streams cut without their error event; a helper's review).
    drain_s = spec.gateway.drain_deadline_s
    args += ["--shutdown-timeout", str(math.ceil(drain_s))]
    sel = _selector(o, "gateway")
    sa = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(o, name, "gateway")}
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _meta(o, name, "gateway"),
        "rules": [
            {
                "apiGroups": ["discovery.k8s.io"],
                "resources": ["endpointslices"],
                "verbs": ["list", "watch"],  # all discovery asks (k8s/discovery.py)
            }
        ],
    }
    binding = _binding(o, name, "gateway", "Role")
    # A Secret, not a ConfigMap: the settings may hold secrets (`priority_keys` are raw API
    # keys, `rate_limit.redis_url` may carry a password), and the gateway reads one file.
    gateway_yaml = yaml.safe_dump(settings, sort_keys=True)
    config = _secret(_meta(o, f"{name}-config", "gateway"), {"gateway.yaml": gateway_yaml})
    token = _secret(_meta(o, f"{o.prefix}-admin-token", "gateway"), {"token": o.admin_token or ""})
    checksum = _checksum(gateway_yaml, o.admin_token or "", *keys.values())
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(o, name, "gateway"),
        "spec": {
            "replicas": o.gateway_replicas,
            "selector": {"matchLabels": sel},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "template": {
                "metadata": {
                    "labels": _meta(o, name, "gateway")["labels"],
                    "annotations": {"checksum/config": checksum},
                },
                "spec": {
                    "serviceAccountName": name,
                    # The preStop sleep counts against it, then the drain, then margin.
                    "terminationGracePeriodSeconds": math.ceil(
                        GATEWAY_PRESTOP_S + math.ceil(drain_s) + GRACE_MARGIN_S
                    ),
                    "enableServiceLinks": False,
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": 10001,
                        "runAsGroup": 10001,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "affinity": _spread(sel),
                    "containers": [
                        {
                            "name": "gateway",
                            "image": o.image,
                            "command": ["unbroken"],
                            "args": args,
                            "env": [*_env_pod(), _env_token(o), *keys_env],
                            "ports": [
                                {"name": "http", "containerPort": GATEWAY_PORT},
                                {"name": "admin", "containerPort": ADMIN_PORT},
                            ],
                            "readinessProbe": _http_probe("/health", "http", 5, 2),
                            # /liveness: the process answers (/health is 503 while it drains
                            # its streams at SIGTERM, up to 30 s: a restart would cut them).
                            "livenessProbe": _http_probe("/liveness", "http", 10, 3),
                            # Let the Service's endpoints drop this pod before SIGTERM.
                            "lifecycle": {
                                "preStop": {"exec": {"command": ["sleep", str(GATEWAY_PRESTOP_S)]}}
                            },
                            "resources": {
                                "requests": {"cpu": "1", "memory": "512Mi"},
                                "limits": {"memory": "2Gi"},
                            },
                            "securityContext": _restricted(),
                            "volumeMounts": [
                                {"name": "config", "mountPath": "/etc/unbroken", "readOnly": True},
                                {"name": "tmp", "mountPath": "/tmp"},
                            ],
                        }
                    ],
                    "volumes": [
                        {"name": "config", "secret": {"secretName": f"{name}-config"}},
                        {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}},
                    ],
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(o, name, "gateway"),
        "spec": {
            "selector": sel,
            "ports": [{"name": "http", "port": 80, "targetPort": "http"}],
        },
    }
    # Headless: its DNS name resolves to every ready gateway pod (the engines' preStop drains
    # on each), and its EndpointSlices are how replicas count each other for cap shares.
    admin = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(o, f"{name}-admin", "gateway"),
        "spec": {
            "clusterIP": "None",
            "selector": sel,
            "ports": [{"name": "admin", "port": ADMIN_PORT, "targetPort": "admin"}],
        },
    }
    pdb = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(o, name, "gateway"),
        "spec": {"minAvailable": 1, "selector": {"matchLabels": sel}},
    }
    # The admin API (drain, caps, routes) only from the engines' preStop hooks and the
    # controller; the OpenAI port from anywhere. The token guards it too; this is depth.
    netpol = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(o, name, "gateway"),
        "spec": {
            "podSelector": {"matchLabels": sel},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"ports": [{"port": GATEWAY_PORT, "protocol": "TCP"}]},
                {
                    "ports": [{"port": ADMIN_PORT, "protocol": "TCP"}],
                    "from": [
                        {"podSelector": {"matchLabels": _selector(o, "engine")}},
                        {"podSelector": {"matchLabels": _selector(o, "controller")}},
                    ],
                },
            ],
        },
    }
    return [sa, role, binding, config, token, deployment, service, admin, pdb, netpol]


def _spread(sel: dict[str, str]) -> Obj:
    return {
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 100,
                    "podAffinityTerm": {
                        "labelSelector": {"matchLabels": sel},
                        "topologyKey": "kubernetes.io/hostname",
                    },
                }
            ]
        }
    }


def _binding(o: RenderOptions, name: str, component: str, kind: str) -> Obj:
    cluster = kind == "ClusterRole"
    meta = _meta(o, name, component)
    meta_ns = meta["namespace"]
    if cluster:
        meta = {k: v for k, v in meta.items() if k != "namespace"}
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding" if cluster else "RoleBinding",
        "metadata": meta,
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": kind, "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": meta_ns}],
    }


# -- controller ------------------------------------------------------------------------------
def controller_objects(spec: PipelineSpec, o: RenderOptions) -> list[Obj]:
    name = f"{o.prefix}-controller"
    sa = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(o, name, "controller")}
    # All it asks the API for is EndpointSlices (k8s.discovery): the gateway's here, the
    # agent's in the agent's namespace. No pods, no Deployments, no writes.
    slices = {
        "apiGroups": ["discovery.k8s.io"],
        "resources": ["endpointslices"],
        "verbs": ["list", "watch"],
    }
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _meta(o, name, "controller"),
        "rules": [slices],
    }
    agent_meta = {**_meta(o, name, "controller"), "namespace": o.agent_ns}
    agent_role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": agent_meta,
        "rules": [slices],
    }
    agent_binding = {
        **_binding(o, name, "controller", "Role"),
        "metadata": agent_meta,
    }
    # Every gateway replica and every node's agent, from their Services' EndpointSlices (the
    # Roles above allow exactly that): each gateway replica keeps its own caps and routes.
    args = ["controller", "--gateway-service", f"{o.namespace}/{o.prefix}-gateway-admin:admin"]
    args += ["--agent-service", f"{o.agent_ns}/{o.prefix}-agent:metrics"]
    args += ["--listen", f"0.0.0.0:{CONTROLLER_PORT}"]
    for p in spec.pools:
        args += ["--degraded-pool" if p.precision == "fp8" else "--full-pool", p.name]
    sel = _selector(o, "controller")
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(o, name, "controller"),
        "spec": {
            # One decision maker: two would fight over the same caps.
            "replicas": 1,
            "selector": {"matchLabels": sel},
            "strategy": {"type": "Recreate"},
            "template": {
                "metadata": {
                    "labels": _meta(o, name, "controller")["labels"],
                    "annotations": {"checksum/config": _checksum(o.admin_token or "")},
                },
                "spec": {
                    "serviceAccountName": name,
                    "enableServiceLinks": False,
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": 10001,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "containers": [
                        {
                            "name": "controller",
                            "image": o.image,
                            "command": ["unbroken"],
                            "args": args,
                            "env": [_env_token(o)],
                            "ports": [{"name": "http", "containerPort": CONTROLLER_PORT}],
                            "readinessProbe": _http_probe("/metrics", "http", 10, 3),
                            "livenessProbe": _http_probe("/metrics", "http", 20, 3),
                            "resources": {
                                "requests": {"cpu": "100m", "memory": "128Mi"},
                                "limits": {"memory": "512Mi"},
                            },
                            "securityContext": _restricted(),
                        }
                    ],
                },
            },
        },
    }
    binding = _binding(o, name, "controller", "Role")
    return [sa, role, binding, agent_role, agent_binding, deployment]


# -- agent -----------------------------------------------------------------------------------
def agent_objects(o: RenderOptions) -> list[Obj]:
    name = f"{o.prefix}-agent"
    caps = [*AGENT_CAPABILITIES, *(["SYS_RESOURCE"] if o.agent_old_kernel else [])]
    sa = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(o, name, "agent")}
    meta = {k: v for k, v in _meta(o, name, "agent").items() if k != "namespace"}
    # The kubelet authorizes GET /pods as nodes/proxy: the agent maps container ids to pods
    # with it. Read-only, but nodes/proxy is broad: see docs/kubernetes.md.
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": meta,
        "rules": [{"apiGroups": [""], "resources": ["nodes/proxy"], "verbs": ["get"]}],
    }
    sel = _selector(o, "agent")
    daemonset = {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": _meta(o, name, "agent"),
        "spec": {
            "selector": {"matchLabels": sel},
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
            "template": {
                "metadata": {"labels": _meta(o, name, "agent")["labels"]},
                "spec": {
                    "serviceAccountName": name,
                    # hostPID: the engines run in other pods, so in other PID namespaces. The
                    # agent finds them by the CUDA libraries in /proc/PID/maps, attaches its
                    # uprobes through /proc/PID/root, and maps sockets to processes through
                    # /proc/PID/fd: none of that is visible from the pod's own PID namespace.
                    "hostPID": True,
                    # Exit is the kernel tearing down each uprobe link (~0.1 s each): the
                    # agent holds only libraries in use (~24 links per engine image, ~3 s);
                    # 30 s covers ~10 distinct copies in use at once (docs/agent.md).
                    "terminationGracePeriodSeconds": 30,
                    "enableServiceLinks": False,
                    "nodeSelector": {"nvidia.com/gpu.present": "true"},
                    "tolerations": [
                        {"key": o.gpu_resource, "operator": "Exists", "effect": "NoSchedule"}
                    ],
                    "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [
                        {
                            "name": "agent",
                            "image": o.agent_image,
                            "command": ["unbroken"],
                            "args": ["agent", "--listen", f"0.0.0.0:{AGENT_PORT}"],
                            "env": [
                                {
                                    "name": "NODE_IP",
                                    "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}},
                                },
                                {"name": "UNBROKEN_CACHE_DIR", "value": "/var/cache/unbroken"},
                            ],
                            "ports": [{"name": "metrics", "containerPort": AGENT_PORT}],
                            "readinessProbe": _http_probe("/metrics", "metrics", 10, 3),
                            "livenessProbe": _http_probe("/metrics", "metrics", 20, 3),
                            "resources": {
                                "requests": {"cpu": "100m", "memory": "128Mi"},
                                "limits": {"memory": "512Mi"},
                            },
                            "securityContext": {
                                # Root in the host user namespace, but only these capabilities.
                                "runAsUser": 0,
                                "privileged": False,
                                "allowPrivilegeEscalation": False,
                                "readOnlyRootFilesystem": True,
                                "capabilities": {"drop": ["ALL"], "add": caps},
                            },
                            "volumeMounts": [
                                {"name": "cache", "mountPath": "/var/cache/unbroken"},
                                {"name": "btf", "mountPath": "/sys/kernel/btf", "readOnly": True},
                            ],
                        }
                    ],
                    "volumes": [
                        {"name": "cache", "emptyDir": {"sizeLimit": "64Mi"}},
                        {
                            "name": "btf",
                            "hostPath": {"path": "/sys/kernel/btf", "type": "Directory"},
                        },
                    ],
                },
            },
        },
    }
    # Headless: one EndpointSlice entry per node's agent, which the controller reads directly
    # (the CUDA signal is per node; a load-balanced Service would give one random node).
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(o, name, "agent"),
        "spec": {
            "clusterIP": "None",
            "selector": _selector(o, "agent"),
            "ports": [{"name": "metrics", "port": AGENT_PORT, "targetPort": "metrics"}],
        },
    }
    return [sa, role, _binding(o, name, "agent", "ClusterRole"), daemonset, service]


# -- monitoring ------------------------------------------------------------------------------
def monitoring_objects(spec: PipelineSpec, o: RenderOptions) -> list[Obj]:
    def meta(name: str, component: str) -> Obj:
        m = _meta(o, name, component)
        m["labels"] |= dict(o.monitor_labels)
        return m

    def pod_monitor(name: str, component: str, port: str, honor: bool) -> Obj:
        endpoint: Obj = {"port": port, "path": "/metrics", "interval": f"{SCRAPE_S}s"}
        if honor:
            # Their series carry `endpoint` (and the agent's `pod`, `namespace`,
            # `container`: the engine's) themselves; without this the operator's target
            # labels of those names win and theirs become `exported_*`, which the rules and
            # the dashboard do not read.
            endpoint["honorLabels"] = True
        return {
            "apiVersion": "monitoring.coreos.com/v1",
            "kind": "PodMonitor",
            "metadata": meta(f"{o.prefix}-{name}", component),
            "spec": {
                "selector": {"matchLabels": _selector(o, component)},
                # The agent's histograms are cumulative in-kernel; the controller reads them
                # every 250 ms itself. 5 s here is for dashboards.
                "podMetricsEndpoints": [endpoint],
            },
        }

    return [
        pod_monitor("gateway", "gateway", "http", honor=True),
        pod_monitor("engines", "engine", "http", honor=False),
        pod_monitor("agent", "agent", "metrics", honor=True),
        pod_monitor("controller", "controller", "http", honor=True),
        {
            "apiVersion": "monitoring.coreos.com/v1",
            "kind": "PrometheusRule",
            "metadata": meta(o.prefix, "monitoring"),
            "spec": prometheus_rule(spec.gateway.drain_deadline_s),
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                **_meta(o, f"{o.prefix}-dashboard", "monitoring"),
                "labels": {**_meta(o, "", "monitoring")["labels"], "grafana_dashboard": "1"},
            },
            "data": {"unbroken.json": dashboard()},
        },
    ]


def namespaces(o: RenderOptions) -> list[Obj]:
    """The pipeline's namespace enforces the "baseline" pod security level (vLLM runs as root,
    so not "restricted"; a warning names what is not). Only the agent's namespace allows
    more, for hostPID and its three capabilities; still no privileged container."""

    def ns(name: str, enforce: str) -> Obj:
        return {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {
                "name": name,
                "labels": {
                    "pod-security.kubernetes.io/enforce": enforce,
                    "pod-security.kubernetes.io/warn": "restricted",
                },
            },
        }

    return [ns(o.namespace, "baseline"), ns(o.agent_ns, "privileged")]


def check_names(spec: PipelineSpec, o: RenderOptions) -> None:
    """Names the API server would refuse, refused here with the value and its limit: the
    namespaces are DNS-1123 labels, Services (`PREFIX-POOL`, `PREFIX-gateway-admin`) DNS-1035
    labels, each at most 63 characters."""
    if not DNS1123_LABEL.match(o.namespace) or len(o.agent_ns) > LABEL_MAX:
        raise ValueError(
            f"namespace {o.namespace!r}: lowercase letters, digits and '-' (a DNS-1123 label), "
            f"at most {LABEL_MAX - len('-agent')} characters (the agent's namespace "
            f"{o.agent_ns!r} adds '-agent' within the limit of {LABEL_MAX})"
        )
    if not DNS1035_LABEL.match(o.prefix) or len(f"{o.prefix}-gateway-admin") > LABEL_MAX:
        raise ValueError(f"prefix {o.prefix!r}: a DNS-1035 label (a letter first), short")
    for p in spec.pools:
        svc = f"{o.prefix}-{p.name}"
        if len(svc) > LABEL_MAX:
            raise ValueError(
                f"pools.{p.name}: the pool's Service name {svc!r} has {len(svc)} characters, "
                f"over the {LABEL_MAX} of a DNS-1035 label: at most "
                f"{LABEL_MAX - len(o.prefix) - 1} characters for a pool name"
            )
    for key, value in o.monitor_labels:
        if not LABEL_VALUE.match(value) or len(value) > LABEL_MAX or not key:
            raise ValueError(f"monitor label {key}={value}: not a valid label")


def build(spec: PipelineSpec, o: RenderOptions) -> list[Obj]:
    """Every object of the pipeline, namespace first."""
    if o.engine not in ("vllm", "simulator"):
        raise ValueError(f"engine must be vllm or simulator, not {o.engine!r}")
    if o.gateway_replicas < 2:
        raise ValueError("the gateway needs 2 or more replicas (its PodDisruptionBudget keeps 1)")
    check_names(spec, o)
    if not o.admin_token:  # one token for every object that carries it
        o = replace(o, admin_token=secrets.token_urlsafe(32))
    hpa = any(autoscaled(p, o.autoscaler) for p in spec.pools) and o.autoscaler == "hpa"
    objs = namespaces(o)
    if o.engine == "vllm":
        objs.append(model_cache(o))
    for pool in spec.pools:
        objs += engine_objects(spec, pool, o)
    if hpa:
        objs.append(adapter_rules(_meta(o, f"{o.prefix}-prometheus-adapter-rules", "monitoring")))
    objs += gateway_objects(spec, o)
    objs += controller_objects(spec, o)
    objs += agent_objects(o)
    objs += monitoring_objects(spec, o)
    return objs
