"""Autoscaling on a cluster (issue 24) and multi-model pools (issue 25) in `render k8s`.

The KEDA kinds are validated against KEDA's own ScaledObject CRD kept in the repository
(src/unbroken/k8s/crds/, with its version and source), strictly: unknown fields, wrong
types and the CRD's CEL rule are refused; built-in kinds against the Kubernetes 1.30
schemas, as test_k8s_render.py does. The scale-in path runs for real: a pod deletion as the
kubelet performs it (the rendered preStop hook, then SIGTERM within the grace period)
drains the pod on the gateway, migrates its stream at the deadline, and the client reads
the same bytes an uninterrupted stream gives."""

from __future__ import annotations

import copy
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate
import orjson
import pytest
import yaml

from helpers import MODEL, TOKEN, Proc, admin, engine, gateway, metric, wait_endpoints, wait_for
from unbroken.config.spec import PipelineSpec, parse_spec
from unbroken.engine.textmodel import expected_completion
from unbroken.k8s import RenderOptions, grace_period, hooks, render, write
from unbroken.k8s.autoscale import DEMAND_METRIC, adapter_rule, demand_query
from unbroken.k8s.crdschema import (
    KEDA_SCALEDOBJECTS,
    crd_body_sha256,
    load_crd,
    strict_schema,
    validate,
)
from unbroken.k8s.manifests import HOOK_MARGIN_S, SCRAPE_S, build
from unbroken.k8s.policy import check
from unbroken.wire.http import free_port
from unbroken.wire.sse import SSEDecoder

K8S = "1.30.0"
CUSTOM = ("monitoring.coreos.com/v1", "keda.sh/v1alpha1")


def elastic_spec(**scaling: Any) -> PipelineSpec:
    """Two autoscaled pools (one may sleep) and a fixed one."""
    return parse_spec(
        {
            "model": "meta-llama/Llama-3.1-8B-Instruct",
            "pools": [
                {
                    "name": "primary",
                    "replicas": {"min": 2, "max": 8},
                    "scaling": {"target": 12.5, **scaling},
                },
                {"name": "fallback", "precision": "fp8", "replicas": {"min": 0, "max": 3}},
                {"name": "fixed", "replicas": 2},
            ],
            "gateway": {"drain_deadline_s": 20},
        }
    )


def multi_model_spec() -> PipelineSpec:
    return parse_spec(
        {
            "model": "meta-llama/Llama-3.1-8B-Instruct",
            "pools": [
                {"name": "llama", "aliases": ["llama", "chat"]},
                {
                    "name": "qwen",
                    "model": "Qwen/Qwen2.5-7B-Instruct",
                    "adapters": {"sql": "/models/lora/sql", "support": None},
                    "replicas": {"min": 1, "max": 4},
                },
                {
                    "name": "mistral",
                    "model": "mistralai/Mistral-7B-Instruct-v0.3",
                    "weights": "/models/mistral",
                    "adapters": [
                        {"name": "legal", "path": "/models/lora/legal"},
                        {
                            "name": "legal-base",
                            "path": "/models/lora/lb",
                            "base": "mistral-base",
                        },
                    ],
                    "aliases": ["mistral-base"],
                },
            ],
        }
    )


def by(objs: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [
        o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]


def engine_container(d: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in d["spec"]["template"]["spec"]["containers"] if c["name"] == "engine")


def keda_ok(o: dict[str, Any]) -> None:
    assert validate(o, KEDA_SCALEDOBJECTS) == []
    meta = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": o["metadata"]}
    kubernetes_validate.validate(meta, K8S, strict=True)  # ObjectMeta, which a CRD leaves open


CASES = {f"{a}-{e}": (a, e) for a in ("keda", "hpa", "none") for e in ("vllm", "simulator")}


@pytest.mark.parametrize("case", list(CASES))
def test_every_object_validates(case: str) -> None:
    autoscaler, eng = CASES[case]
    for spec in (elastic_spec(), multi_model_spec()):
        objs = render(spec, RenderOptions(autoscaler=autoscaler, engine=eng))
        assert check(objs) == []
        for o in objs:
            if o["apiVersion"] == "keda.sh/v1alpha1":
                keda_ok(o)
            elif o["apiVersion"] not in CUSTOM:
                kubernetes_validate.validate(o, K8S, strict=True)
        kinds = {o["kind"] for o in objs}
        assert ("ScaledObject" in kinds) == (autoscaler == "keda")
        assert ("HorizontalPodAutoscaler" in kinds) == (autoscaler == "hpa")


def test_the_crd_is_keda_s_own_and_named_by_its_version() -> None:
    recorded, actual = crd_body_sha256(KEDA_SCALEDOBJECTS)
    assert recorded == actual  # not edited since it was copied from kedacore/keda
    header = KEDA_SCALEDOBJECTS.read_text().split("\n---", 1)[0]
    assert "v2.20.2" in header and "kedacore/keda" in header
    assert "2.20.2" in KEDA_SCALEDOBJECTS.name
    crd = load_crd(KEDA_SCALEDOBJECTS)
    assert crd["metadata"]["name"] == "scaledobjects.keda.sh"
    assert [v["name"] for v in crd["spec"]["versions"]] == ["v1alpha1"]


def _so() -> dict[str, Any]:
    return by(render(elastic_spec(), RenderOptions()), "ScaledObject", "unbroken-primary")[0]


def _set(path: str, value: Any) -> Any:
    def how(o: dict[str, Any]) -> None:
        *head, last = path.split(".")
        for k in head:
            o = o[int(k)] if isinstance(o, list) else o[k]
        if isinstance(o, list):
            o[int(last)] = value
        else:
            o[last] = value

    return how


BROKEN = {
    "unknown spec field": (_set("spec.minReplicas", 1), "Additional properties"),
    "unknown deep field": (
        _set("spec.advanced.horizontalPodAutoscalerConfig.behavior.scaleDown.window", 30),
        "Additional properties",
    ),
    "unknown trigger field": (_set("spec.triggers.0.threshold", "48"), "Additional properties"),
    "string count": (_set("spec.minReplicaCount", "1"), "is not of type 'integer'"),
    "float count": (_set("spec.maxReplicaCount", 4.0), "is not of type 'integer'"),
    "int32 overflow": (_set("spec.pollingInterval", 2**31), "int32"),
    "below minimum": (_set("spec.maxReplicaCount", 0), "less than the minimum"),
    "trigger metadata not strings": (
        _set("spec.triggers.0.metadata.threshold", 48),
        "is not of type 'string'",
    ),
    "min above max (CEL)": (_set("spec.minReplicaCount", 9), "less than or equal to"),
    "no triggers": (_set("spec.triggers", []), "should be non-empty"),
    "wrong version": (_set("apiVersion", "keda.sh/v1"), "apiVersion"),
    "bad fallback behavior": (_set("spec.fallback.behavior", "max"), "is not one of"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_crd_validation_refuses(case: str) -> None:
    how, message = BROKEN[case]
    o = copy.deepcopy(_so())
    assert validate(o, KEDA_SCALEDOBJECTS) == []
    how(o)
    errors = validate(o, KEDA_SCALEDOBJECTS)
    assert any(message in e for e in errors), errors


def test_unknown_cel_rule_is_not_passed_silently(tmp_path: Path) -> None:
    crd = load_crd(KEDA_SCALEDOBJECTS)
    crd = copy.deepcopy(crd)
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec["x-kubernetes-validations"].append({"rule": "self.pollingInterval < 3"})
    path = tmp_path / "crd.yaml"
    path.write_text(yaml.safe_dump(crd))
    assert any("cannot check" in e for e in validate(_so(), path))
    # Objects of preserve-unknown-fields schemas stay open; others are closed.
    s = strict_schema(
        {
            "type": "object",
            "properties": {
                "open": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                "map": {"type": "object", "additionalProperties": {"type": "string"}},
                "closed": {"type": "object", "properties": {"a": {"type": "string"}}},
            },
        }
    )
    assert s["additionalProperties"] is False
    assert "additionalProperties" not in s["properties"]["open"]
    assert s["properties"]["map"]["additionalProperties"] == {"type": "string"}
    assert s["properties"]["closed"]["additionalProperties"] is False


def test_scaled_object_maps_the_spec() -> None:
    spec = elastic_spec(down_quiet_s=45, down_cooldown_s=20, up_cooldown_s=0)
    objs = render(spec, RenderOptions(namespace="llm", prometheus_url="http://prom:9090"))
    so = by(objs, "ScaledObject", "unbroken-primary")[0]["spec"]
    dep = by(objs, "Deployment", "unbroken-primary")[0]
    assert so["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": dep["metadata"]["name"],
    }
    assert (so["minReplicaCount"], so["maxReplicaCount"]) == (2, 8)
    (trig,) = so["triggers"]
    assert trig["type"] == "prometheus" and trig["metricType"] == "AverageValue"
    md = trig["metadata"]
    assert md["query"] == f'sum({DEMAND_METRIC}{{namespace="llm",pool="primary"}})'
    assert md["threshold"] == "12.5" and md["serverAddress"] == "http://prom:9090"
    assert md["ignoreNullValues"] == "false"  # no series is not zero demand
    b = so["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert b["scaleDown"]["stabilizationWindowSeconds"] == 45
    assert b["scaleDown"]["policies"] == [{"type": "Pods", "value": 1, "periodSeconds": 20}]
    assert b["scaleUp"]["stabilizationWindowSeconds"] == 0
    up = {p["type"]: p for p in b["scaleUp"]["policies"]}
    assert b["scaleUp"]["selectPolicy"] == "Max"
    assert up["Pods"]["value"] == 8 and up["Percent"]["value"] == 100  # 2 -> 8 in one step
    assert up["Pods"]["periodSeconds"] == 1  # a 0 s cool-down is the API's minimum, 1 s
    assert so["pollingInterval"] == SCRAPE_S
    pm = by(objs, "PodMonitor", "unbroken-gateway")[0]["spec"]["podMetricsEndpoints"][0]
    assert pm["interval"] == f"{SCRAPE_S}s"
    assert so["cooldownPeriod"] == 45
    # The pool that may sleep: KEDA takes it to 0; its fallback wakes it to 1 if the signal
    # is lost, and never scales anything in on a lost signal.
    fb = by(objs, "ScaledObject", "unbroken-fallback")[0]["spec"]
    assert fb["minReplicaCount"] == 0 and fb["maxReplicaCount"] == 3
    assert fb["fallback"] == {
        "failureThreshold": 3,
        "replicas": 1,
        "behavior": "currentReplicasIfHigher",
    }
    assert fb["triggers"][0]["metadata"]["threshold"] == "48"  # the spec's default target
    assert not by(objs, "ScaledObject", "unbroken-fixed")


def test_the_autoscaler_owns_the_replica_count() -> None:
    for autoscaler in ("keda", "hpa"):
        objs = render(elastic_spec(), RenderOptions(autoscaler=autoscaler))
        for pool in ("primary", "fallback"):
            d = by(objs, "Deployment", f"unbroken-{pool}")[0]
            assert "replicas" not in d["spec"], (autoscaler, pool)
        assert by(objs, "Deployment", "unbroken-fixed")[0]["spec"]["replicas"] == 2
    none = render(elastic_spec(), RenderOptions(autoscaler="none"))
    reps = {d["metadata"]["name"]: d["spec"]["replicas"] for d in by(none, "Deployment")}
    assert reps["unbroken-primary"] == 2 and reps["unbroken-fallback"] == 1  # never 0
    with pytest.raises(ValueError, match="autoscaler must be one of"):
        build(elastic_spec(), RenderOptions(autoscaler="vpa"))


def test_hpa_and_the_adapter_rule() -> None:
    objs = render(elastic_spec(), RenderOptions(autoscaler="hpa", namespace="llm"))
    hpa = by(objs, "HorizontalPodAutoscaler", "unbroken-primary")[0]["spec"]
    assert hpa["scaleTargetRef"]["name"] == "unbroken-primary"
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (2, 8)
    (m,) = hpa["metrics"]
    assert m["type"] == "External"
    assert m["external"]["metric"] == {
        "name": DEMAND_METRIC,
        "selector": {"matchLabels": {"pool": "primary"}},
    }
    assert m["external"]["target"] == {"type": "AverageValue", "averageValue": "12.5"}
    assert hpa["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 30
    # A plain HPA cannot scale from 0: min 0 becomes 1 (KEDA is the way to sleep).
    fb = by(objs, "HorizontalPodAutoscaler", "unbroken-fallback")[0]["spec"]
    assert fb["minReplicas"] == 1
    cm = by(objs, "ConfigMap", "unbroken-prometheus-adapter-rules")[0]["data"]
    (rule,) = yaml.safe_load(cm["config.yaml"])["externalRules"]
    assert rule == adapter_rule()
    assert yaml.safe_load(cm["values.yaml"])["rules"]["external"] == [rule]
    # The adapter's query, with the matchers it adds (the HPA's namespace and selector),
    # is the sum KEDA's trigger runs.
    matchers = 'namespace="llm",pool="primary"'
    q = rule["metricsQuery"].replace("<<.Series>>", DEMAND_METRIC)
    q = q.replace("<<.LabelMatchers>>", matchers)
    assert q == f"sum by (pool) ({DEMAND_METRIC}{{{matchers}}})"
    assert demand_query("llm", "primary") == f"sum({DEMAND_METRIC}{{{matchers}}})"
    assert rule["name"]["as"] == m["external"]["metric"]["name"]
    assert not by(
        render(elastic_spec(), RenderOptions()), "ConfigMap", "unbroken-prometheus-adapter-rules"
    )


def test_grace_covers_the_scale_in_drain() -> None:
    """An autoscaled pool's preStop deadline is the longer of the gateway's and the scaling
    drain deadline (a pod cannot tell a scale-in from a rollout, and a gateway that sees the
    slice's `terminating` first drains with its own), and the grace period follows it."""
    for scale_drain, want in ((60, 60), (5, 20)):
        spec = elastic_spec(drain_deadline_s=scale_drain)
        objs = build(spec, RenderOptions())
        for pool, deadline in (("primary", want), ("fixed", 20)):
            d = by(objs, "Deployment", f"unbroken-{pool}")[0]
            pre = engine_container(d)["lifecycle"]["preStop"]["exec"]["command"]
            assert float(pre[pre.index("--deadline") + 1]) == deadline
            assert float(pre[pre.index("--timeout") + 1]) == deadline + HOOK_MARGIN_S
            grace = d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            assert grace == grace_period(deadline, 30) >= deadline + HOOK_MARGIN_S + 30
        assert check(objs) == []


def _target_of(name: str) -> Any:
    return lambda o: o["spec"]["scaleTargetRef"].update(name=name)


POLICY = {
    "replicas set": (
        lambda objs: by(objs, "Deployment", "unbroken-primary")[0]["spec"].update(replicas=2),
        "sets replicas",
    ),
    "no such target": (
        lambda objs: _target_of("unbroken-nothing")(by(objs, "ScaledObject")[0]),
        "not a Deployment here",
    ),
    "not an engine": (
        lambda objs: _target_of("unbroken-gateway")(by(objs, "ScaledObject")[0]),
        "not an engine pool",
    ),
    "two autoscalers": (
        lambda objs: _target_of("unbroken-primary")(
            by(objs, "ScaledObject", "unbroken-fallback")[0]
        ),
        "already scaled by",
    ),
    "min above max": (
        lambda objs: by(objs, "ScaledObject")[0]["spec"].update(minReplicaCount=20),
        "min 20 > max",
    ),
}


@pytest.mark.parametrize("rule", list(POLICY))
def test_policy_catches_autoscaler_mistakes(rule: str) -> None:
    how, message = POLICY[rule]
    objs = build(elastic_spec(), RenderOptions())
    assert check(objs) == []
    how(objs)
    assert any(message in b for b in check(objs)), check(objs)


def test_multi_model_vllm_args() -> None:
    spec = multi_model_spec()
    objs = render(spec, RenderOptions())

    def args(pool: str) -> list[str]:
        return engine_container(by(objs, "Deployment", f"unbroken-{pool}")[0])["args"]

    def served(a: list[str]) -> list[str]:
        i = a.index("--served-model-name") + 1
        return a[i : next(j for j in range(i, len(a) + 1) if j == len(a) or a[j][:2] == "--")]

    llama = args("llama")
    assert llama[:2] == ["serve", "meta-llama/Llama-3.1-8B-Instruct"]
    assert served(llama) == ["meta-llama/Llama-3.1-8B-Instruct", "llama", "chat"]
    assert "--enable-lora" not in llama and "--lora-modules" not in llama
    qwen = args("qwen")
    assert qwen[:2] == ["serve", "Qwen/Qwen2.5-7B-Instruct"]
    assert served(qwen) == ["Qwen/Qwen2.5-7B-Instruct"]
    assert "--enable-lora" in qwen and qwen[qwen.index("--max-loras") + 1] == "2"
    i = qwen.index("--lora-modules")
    # No path: the name is the path (a Hugging Face repository id for vLLM).
    assert qwen[i + 1 : i + 3] == ["sql=/models/lora/sql", "support=support"]
    mistral = args("mistral")
    assert mistral[:2] == ["serve", "/models/mistral"]  # its weights, served by its name
    assert served(mistral) == ["mistralai/Mistral-7B-Instruct-v0.3", "mistral-base"]
    i = mistral.index("--lora-modules")
    assert mistral[i + 1] == "legal=/models/lora/legal"
    assert orjson.loads(mistral[i + 2]) == {
        "name": "legal-base",
        "path": "/models/lora/lb",
        "base_model_name": "mistral-base",
    }
    for pool in spec.pools:
        c = engine_container(by(objs, "Deployment", f"unbroken-{pool.name}")[0])
        ready = c["readinessProbe"]["exec"]["command"]
        # Warm up the pool's base model, not whatever /v1/models lists first.
        assert ready[ready.index("--model") + 1] == pool.model_of(spec)
        assert set(served(c["args"])) | {a.name for a in pool.adapters} == set(
            pool.served_names(spec)
        )


def test_multi_model_simulator_args() -> None:
    spec = multi_model_spec()
    objs = render(spec, RenderOptions(engine="simulator"))
    for pool in spec.pools:
        c = engine_container(by(objs, "Deployment", f"unbroken-{pool.name}")[0])
        a = c["args"]
        assert c["command"] == ["unbroken"] and a[0] == "engine"
        assert "--model" not in a
        i = a.index("--served-model-name")
        assert a[i + 1 : i + 2 + len(pool.aliases)] == [pool.model_of(spec), *pool.aliases]
        assert ("--lora-modules" in a) == bool(pool.adapters) == ("--enable-lora" in a)
    qwen = engine_container(by(objs, "Deployment", "unbroken-qwen")[0])["args"]
    i = qwen.index("--lora-modules")
    assert qwen[i + 1 : i + 3] == ["sql=/models/lora/sql", "support=support"]
    # The gateway discovers every pool; the model names come from the engines themselves.
    gw = by(objs, "Deployment", "unbroken-gateway")[0]["spec"]["template"]["spec"]
    assert gw["containers"][0]["args"].count("--k8s-service") == 3


def test_write_puts_keda_objects_apart(tmp_path: Path) -> None:
    paths = write(render(elastic_spec(), RenderOptions()), tmp_path)
    keda = sorted((tmp_path / "keda").glob("*.yaml"))
    assert [p.name.split("-", 1)[1] for p in keda] == [
        "scaledobject-unbroken-primary.yaml",
        "scaledobject-unbroken-fallback.yaml",
    ]
    for p in keda:
        keda_ok(yaml.safe_load(p.read_text()))
    top = [p for p in paths if p.parent == tmp_path]
    for p in top:
        kubernetes_validate.validate(yaml.safe_load(p.read_text()), K8S, strict=True)


def test_cli_renders_a_range_with_keda(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        yaml.safe_dump({"pools": [{"name": "primary", "replicas": {"min": 1, "max": 3}}]})
    )
    out = tmp_path / "out"
    p = subprocess.run(
        [sys.executable, "-m", "unbroken", "render", "k8s", str(spec), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    (so,) = (yaml.safe_load(f.read_text()) for f in (out / "keda").glob("*.yaml"))
    keda_ok(so)
    assert so["spec"]["maxReplicaCount"] == 3


# -- the scale-in path, run -------------------------------------------------------------------
def _stream(url: str, body: dict[str, Any], on_first: Any) -> tuple[str, str]:
    """Stream a completion; `on_first(endpoint)` once 10 tokens arrived."""
    dec = SSEDecoder()
    text: list[str] = []
    with httpx.stream(
        "POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60
    ) as r:
        assert r.status_code == 200, r.read()
        ep = r.headers["x-unbroken-endpoint"]
        for chunk in r.iter_raw():
            for ev in dec.feed(chunk):
                if ev.data is None or ev.is_done:
                    continue
                obj = orjson.loads(ev.data)
                assert "error" not in obj, obj
                for c in obj.get("choices", []):
                    if c.get("text"):
                        text.append(c["text"])
                        if len(text) == 10:
                            on_first(ep)
    return "".join(text), ep


def test_scale_in_pod_deletion_drains_and_drops_nothing(tmp_path: Path) -> None:
    """What a scale-in is on a cluster: the autoscaler lowers the Deployment's count, the
    ReplicaSet deletes one pod, and the kubelet runs that pod's preStop hook, then sends
    SIGTERM, all within terminationGracePeriodSeconds. Here the kubelet's part is played by
    this test with the rendered objects of an autoscaled pool: the rendered preStop command
    (the copied hooks.py under `python3 -S`, as in the vLLM image) on the pod that holds a
    stream, then SIGTERM. The drain reaches the gateway, the stream is migrated to the other
    replica at the deadline, the client's text is byte for byte what an unbroken stream
    gives, and the engine gets SIGTERM only when no stream is left on it."""
    spec = parse_spec(
        {
            "pools": [
                {
                    "name": "primary",
                    "replicas": {"min": 1, "max": 2},
                    "scaling": {"drain_deadline_s": 1.0},
                }
            ],
            "gateway": {"drain_deadline_s": 0.5},
        }
    )
    objs = render(spec, RenderOptions(engine="simulator"))
    dep = by(objs, "Deployment", "unbroken-primary")[0]
    assert "replicas" not in dep["spec"] and by(objs, "ScaledObject", "unbroken-primary")
    pod = dep["spec"]["template"]["spec"]
    grace = pod["terminationGracePeriodSeconds"]
    pre = engine_container(dep)["lifecycle"]["preStop"]["exec"]["command"]
    assert float(pre[pre.index("--deadline") + 1]) == 1.0  # the longer of the two

    slow = ("--decode-base-s", "0.01")  # 300 tokens take 3 s or more: past the deadline
    engines = {n: engine(tmp_path, *slow, name=n) for n in ("a", "b")}
    g = gateway(tmp_path, wait_ready=0)
    installed = hooks.install(tmp_path / "opt")
    # The headless admin Service's name resolves to every gateway pod; localhost to the one
    # gateway here. The hooks directory is where the initContainer copied hooks.py.
    subs = {
        pre[pre.index("--admin") + 1]: f"localhost:{g.admin_port}",
        "/opt/unbroken": str(installed.parent),
    }
    local = [subs.get(arg, arg).replace("/opt/unbroken", str(installed.parent)) for arg in pre]
    assert local[:2] == ["python3", str(installed)] and local != pre
    pods = {n: f"unbroken-primary-7d9c-{n}" for n in engines}
    result: dict[str, Any] = {}
    try:
        for n, e in engines.items():
            body = {"url": e.url, "name": f"{pods[n]}.unbroken", "pool": "primary"}
            assert admin(g, "POST", "/admin/endpoints", body).status_code == 201
        wait_endpoints(g, lambda eps: [x["state"] for x in eps] == ["ready", "ready"])

        def delete_pod(endpoint: str) -> None:
            """The kubelet deleting the pod behind `endpoint`."""
            n = next(k for k, v in pods.items() if f"{v}.unbroken" == endpoint)
            t0 = time.monotonic()
            env = {
                "PATH": "/usr/bin:/bin",
                "POD_NAME": pods[n],
                "POD_NAMESPACE": "unbroken",
                "UNBROKEN_ADMIN_TOKEN": TOKEN,
            }
            p = subprocess.run(
                ["python3", "-S", *local[1:]],
                env=env,
                capture_output=True,
                text=True,
                timeout=grace,
            )
            took = time.monotonic() - t0
            # What the hook waited for: the gateway let the endpoint go (no stream on it).
            held = admin(g, "GET", f"/admin/endpoints/{endpoint}").status_code
            engines[n].signal(15)  # SIGTERM after preStop, as the kubelet does
            result.update(rc=p.returncode, err=p.stderr, took=took, held=held, pod=n)

        threads: list[threading.Thread] = []

        def on_first(ep: str) -> None:
            t = threading.Thread(target=delete_pod, args=(ep,))
            threads.append(t)
            t.start()

        prompt = {"model": MODEL, "prompt": "scale in", "max_tokens": 300, "temperature": 0}
        migrated0 = _count(g, "unbroken_gateway_streams_migrated_total")
        text, first = _stream(g.url, prompt, on_first)
        for t in threads:
            t.join(grace)
        assert result["rc"] == 0, result["err"]
        assert "draining" in result["err"], result["err"]
        assert result["took"] <= 1.0 + HOOK_MARGIN_S < grace
        assert result["held"] == 404  # no gateway held the pod when SIGTERM came
        assert text == expected_completion("scale in", 300).text  # byte for byte
        assert _count(g, "unbroken_gateway_streams_migrated_total") >= migrated0 + 1
        left = admin(g, "GET", "/admin/endpoints").json()["endpoints"]
        assert [x["name"] for x in left] == [
            f"{pods[k]}.unbroken" for k in pods if k != result["pod"]
        ]
        gone = engines[result["pod"]]
        wait_for(lambda: gone.popen is not None and gone.popen.poll() is not None, timeout=15)
        assert first == f"{pods[result['pod']]}.unbroken"
    finally:
        for p in (g, *engines.values()):
            p.stop()


def _count(g: Any, name: str) -> float:
    try:
        return metric(g.url, name)
    except KeyError:
        return 0.0


def test_rendered_simulator_pod_serves_its_names(tmp_path: Path) -> None:
    """A multi-model simulator pool's rendered engine args, run: /v1/models lists the pool's
    model, its aliases and its adapters (with the model as their parent), nothing else.
    Run through `python -m unbroken.engine`, the simulator's vLLM-syntax entry point; the
    container runs `unbroken engine` with the same args (the weights, which the prewarm
    initContainer makes, are left out here)."""
    spec = multi_model_spec()
    objs = render(spec, RenderOptions(engine="simulator"))
    pool = next(p for p in spec.pools if p.name == "qwen")
    args = engine_container(by(objs, "Deployment", "unbroken-qwen")[0])["args"]
    i = args.index("--weights")
    args = args[1:i] + args[i + 2 :]
    port = free_port()
    args[args.index("--port") + 1] = str(port)
    args[args.index("--host") + 1] = "127.0.0.1"
    e = Proc([sys.executable, "-m", "unbroken.engine", *args], port, tmp_path / "e.log")
    e.start()
    try:
        cards = httpx.get(e.url + "/v1/models", timeout=5).json()["data"]
        assert sorted(c["id"] for c in cards) == sorted(pool.served_names(spec))
        parents = {c["id"]: c["parent"] for c in cards}
        assert parents["sql"] == parents["support"] == pool.model_of(spec)
        r = httpx.post(
            e.url + "/v1/completions",
            json={"model": "sql", "prompt": "hi", "max_tokens": 3, "temperature": 0},
            timeout=10,
        )
        assert r.status_code == 200 and r.json()["model"] == "sql", r.text
    finally:
        e.stop()
