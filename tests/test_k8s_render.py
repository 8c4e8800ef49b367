"""`unbroken render k8s`: every object valid against the Kubernetes 1.30 schema (strict,
offline, from the kubernetes-validate package), and the policy rules hold on the objects;
each rule is also shown to catch a broken object."""

from __future__ import annotations

import copy
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import orjson
import pytest
import yaml

from unbroken.config.spec import EngineSpec, GatewaySettings, PipelineSpec, PoolSpec, default_spec
from unbroken.k8s import RenderOptions, grace_period, render
from unbroken.k8s.manifests import AGENT_CAPABILITIES, build
from unbroken.k8s.policy import check

K8S = "1.30.0"
CRD = "monitoring.coreos.com/v1"


def custom_spec() -> PipelineSpec:
    return PipelineSpec(
        model="meta-llama/Llama-3.1-8B-Instruct",
        pools=[
            PoolSpec(
                name="big",
                precision="bf16",
                replicas=3,
                cap=6,
                engine=EngineSpec(shutdown_timeout_s=45, overrides={"max_num_seqs": 64}),
            ),
            PoolSpec(name="small", precision="fp8", replicas=1, engine=EngineSpec(profile="fp8")),
        ],
        gateway=GatewaySettings(drain_deadline_s=12.5),
    )


CASES = {
    "default-vllm": (default_spec(), RenderOptions()),
    "default-simulator": (default_spec(), RenderOptions(engine="simulator")),
    "custom-vllm": (custom_spec(), RenderOptions(namespace="llm", gateway_replicas=3)),
    "old-kernel": (default_spec(), RenderOptions(agent_old_kernel=True)),
}


def by(objs: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [
        o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]


def engine_container(d: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in d["spec"]["template"]["spec"]["containers"] if c["name"] == "engine")


@pytest.mark.parametrize("case", list(CASES))
def test_every_object_validates_strict_1_30(case: str) -> None:
    spec, opts = CASES[case]
    objs = render(spec, opts)
    core = [o for o in objs if o["apiVersion"] != CRD]
    assert len(core) >= 20
    for o in core:
        kubernetes_validate.validate(o, K8S, strict=True)
    # Prometheus Operator kinds are CRDs, not in the Kubernetes schema: their shape is
    # checked here and their rules by promtool below.
    for o in objs:
        if o["apiVersion"] == CRD:
            assert o["kind"] in ("PodMonitor", "PrometheusRule")
            kubernetes_validate.validate(
                {"apiVersion": "v1", "kind": "ConfigMap", "metadata": o["metadata"]}, K8S, True
            )


def test_validation_is_not_a_rubber_stamp() -> None:
    objs = render(default_spec(), RenderOptions())
    d = copy.deepcopy(by(objs, "Deployment", "unbroken-primary")[0])
    engine_container(d)["livenessprobe"] = {}  # a typo'd field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(d, K8S, strict=True)


@pytest.mark.parametrize("case", list(CASES))
def test_policy_holds(case: str) -> None:
    spec, opts = CASES[case]
    assert check(build(spec, opts)) == []


def _break(objs: list[dict[str, Any]], kind: str, name: str, how: Any) -> list[str]:
    objs = copy.deepcopy(objs)
    how(by(objs, kind, name)[0])
    return check(objs)


BREAKS = {
    "privileged": (
        "Deployment",
        "unbroken-gateway",
        lambda o: o["spec"]["template"]["spec"]["containers"][0]["securityContext"].update(
            privileged=True
        ),
        "privileged",
    ),
    "no probe": (
        "Deployment",
        "unbroken-controller",
        lambda o: o["spec"]["template"]["spec"]["containers"][0].pop("livenessProbe"),
        "probes required",
    ),
    "no resources": (
        "Deployment",
        "unbroken-primary",
        lambda o: o["spec"]["template"]["spec"]["initContainers"][1].pop("resources"),
        "no cpu/memory requests",
    ),
    "grace": (
        "Deployment",
        "unbroken-primary",
        lambda o: o["spec"]["template"]["spec"].update(terminationGracePeriodSeconds=30),
        "grace rule",
    ),
    "surge": (
        "Deployment",
        "unbroken-primary",
        lambda o: o["spec"]["strategy"]["rollingUpdate"].update(maxUnavailable=1),
        "maxUnavailable 0",
    ),
    "agent caps": (
        "DaemonSet",
        "unbroken-agent",
        lambda o: o["spec"]["template"]["spec"]["containers"][0]["securityContext"]["capabilities"][
            "add"
        ].append("SYS_ADMIN"),
        "beyond the minimum",
    ),
    "gateway caps": (
        "Deployment",
        "unbroken-gateway",
        lambda o: o["spec"]["template"]["spec"]["containers"][0]["securityContext"][
            "capabilities"
        ].update(add=["NET_ADMIN"]),
        "adds capabilities",
    ),
    "hostPID": (
        "Deployment",
        "unbroken-gateway",
        lambda o: o["spec"]["template"]["spec"].update(hostPID=True),
        "hostPID outside the agent",
    ),
    "root gateway": (
        "Deployment",
        "unbroken-gateway",
        lambda o: o["spec"]["template"]["spec"]["securityContext"].update(runAsNonRoot=False),
        "runAsNonRoot",
    ),
    "one gateway": (
        "Deployment",
        "unbroken-gateway",
        lambda o: o["spec"].update(replicas=1),
        "fewer than 2",
    ),
    "rbac": (
        "Role",
        "unbroken-controller",
        lambda o: o["rules"][2].pop("resourceNames"),
        "not limited by resourceNames",
    ),
    "prestop": (
        "Deployment",
        "unbroken-fallback",
        lambda o: engine_container(o).pop("lifecycle"),
        "preStop",
    ),
}


@pytest.mark.parametrize("rule", list(BREAKS))
def test_policy_catches(rule: str) -> None:
    kind, name, how, message = BREAKS[rule]
    bad = _break(build(default_spec(), RenderOptions()), kind, name, how)
    assert any(message in b for b in bad), bad


def test_engines_run_vllm_with_the_pools_settings() -> None:
    spec = custom_spec()
    objs = render(spec, RenderOptions(namespace="llm"))
    for pool in spec.pools:
        d = by(objs, "Deployment", f"unbroken-{pool.name}")[0]
        c = engine_container(d)
        pod = d["spec"]["template"]["spec"]
        assert c["image"].startswith("vllm/vllm-openai:")
        args = c["args"]
        assert args[:2] == ["serve", spec.model]
        assert ("--quantization" in args) == (pool.precision == "fp8")
        assert args[args.index("--shutdown-timeout") + 1] == f"{pool.engine.shutdown_timeout_s:g}"
        assert "--max-num-seqs" in args
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert d["spec"]["replicas"] == pool.replicas
        assert d["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
        # The grace period is computed from the drain deadline and the engine's shutdown.
        want = grace_period(spec.gateway.drain_deadline_s, pool.engine.shutdown_timeout_s)
        assert pod["terminationGracePeriodSeconds"] == want
        pre = c["lifecycle"]["preStop"]["exec"]["command"]
        assert pre[pre.index("--deadline") + 1] == "12.5"
        assert "drain" in pre and "--every-address" in pre
        assert pre[pre.index("--admin") + 1] == "unbroken-gateway-admin.llm.svc:8081"
        ready = c["readinessProbe"]["exec"]["command"]
        assert ready[:3] == ["python3", "/opt/unbroken/hooks.py", "ready"]
        init = {i["name"]: i for i in pod["initContainers"]}
        assert "unbroken prewarm" in init["prewarm"]["command"][-1]
        assert init["hooks"]["command"][-1] == "/opt/unbroken"  # where the probes look
        vols = {v["name"]: v for v in pod["volumes"]}
        assert vols["dshm"]["emptyDir"]["medium"] == "Memory"
        assert "persistentVolumeClaim" in vols["model-cache"]
    assert grace_period(12.5, 45) == 73  # 12.5 + 5 + 45 + 10, rounded up
    big = engine_container(by(objs, "Deployment", "unbroken-big")[0])["args"]
    assert big[big.index("--max-num-seqs") + 1] == "64"


def test_gateway_and_controller_objects() -> None:
    spec = custom_spec()
    objs = render(spec, RenderOptions(namespace="llm", gateway_replicas=3))
    gw = by(objs, "Deployment", "unbroken-gateway")[0]
    args = gw["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args.count("--k8s-service") == 2
    assert "big=llm/unbroken-big:http" in args and "big=6" in args
    assert "small=256" in args  # no pool cap: the gateway default, as a whole
    assert gw["spec"]["replicas"] == 3
    # SIGTERM's drain is the spec's drain deadline (13 s here), and the grace period holds
    # the preStop sleep, that drain and a margin: it was the drain + 10 s while the gateway
    # drained for the CLI's 30 s, so a short drain_deadline_s meant a SIGKILL mid-drain.
    pod = gw["spec"]["template"]["spec"]
    assert args[args.index("--shutdown-timeout") + 1] == "13"
    sleep = int(pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pod["terminationGracePeriodSeconds"] >= sleep + 13 + 5
    assert by(objs, "PodDisruptionBudget", "unbroken-gateway")[0]["spec"]["minAvailable"] == 1
    admin_svc = by(objs, "Service", "unbroken-gateway-admin")[0]
    assert admin_svc["spec"]["clusterIP"] == "None"
    cfg = yaml.safe_load(
        by(objs, "ConfigMap", "unbroken-gateway-config")[0]["data"]["gateway.yaml"]
    )
    assert GatewaySettings.model_validate(cfg).drain_deadline_s == 12.5
    assert GatewaySettings.model_validate(cfg).endpoint_header is False  # no pod names leak
    ctl = by(objs, "Deployment", "unbroken-controller")[0]["spec"]["template"]["spec"]
    ctl_args = ctl["containers"][0]["args"]
    assert "--gateway-service" in ctl_args and "--agent-service" in ctl_args
    agent_svc = by(objs, "Service", "unbroken-agent")[0]
    assert agent_svc["spec"]["clusterIP"] == "None"
    role = by(objs, "Role", "unbroken-controller")[0]
    patch = [r for r in role["rules"] if "patch" in r["verbs"]]
    assert patch == [
        {
            "apiGroups": ["apps"],
            "resources": ["deployments"],
            "resourceNames": ["unbroken-big", "unbroken-small"],
            "verbs": ["get", "patch"],
        }
    ]
    secret = by(objs, "Secret", "unbroken-admin-token")[0]["stringData"]["token"]
    again = by(render(spec, RenderOptions()), "Secret", "unbroken-admin-token")[0]
    assert len(secret) >= 32 and again["stringData"]["token"] != secret


def test_agent_daemonset() -> None:
    objs = render(default_spec(), RenderOptions())
    ds = by(objs, "DaemonSet", "unbroken-agent")[0]
    pod = ds["spec"]["template"]["spec"]
    sc = pod["containers"][0]["securityContext"]
    assert sc["privileged"] is False and sc["capabilities"]["drop"] == ["ALL"]
    assert sc["capabilities"]["add"] == list(AGENT_CAPABILITIES)
    assert {"BPF", "PERFMON"} <= set(AGENT_CAPABILITIES) and "SYS_ADMIN" not in AGENT_CAPABILITIES
    assert pod["hostPID"] is True
    assert ds["metadata"]["namespace"] == "unbroken-agent"
    nss = {o["metadata"]["name"]: o["metadata"]["labels"] for o in by(objs, "Namespace")}
    assert nss["unbroken"]["pod-security.kubernetes.io/enforce"] == "baseline"
    old = by(render(default_spec(), RenderOptions(agent_old_kernel=True)), "DaemonSet")[0]
    caps = old["spec"]["template"]["spec"]["containers"][0]["securityContext"]["capabilities"]
    assert "SYS_RESOURCE" in caps["add"]


def test_monitoring_rules_and_dashboard(tmp_path: Path) -> None:
    objs = render(default_spec(), RenderOptions())
    rule = by(objs, "PrometheusRule")[0]["spec"]
    alerts = {r["alert"] for g in rule["groups"] for r in g["rules"] if "alert" in r}
    assert {"UnbrokenHardwareContention", "UnbrokenStreamsDropped", "UnbrokenDrainStuck"} <= alerts
    board = orjson.loads(by(objs, "ConfigMap", "unbroken-dashboard")[0]["data"]["unbroken.json"])
    titles = " | ".join(p["title"] for p in board["panels"])
    for word in ("TTFT", "Inter-token", "Active streams", "conditions", "CUDA", "backpressure"):
        assert word in titles
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed")
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rule))
    p = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr


def test_cli_writes_the_files(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(custom_spec().model_dump(mode="json")))
    out = tmp_path / "out"
    p = subprocess.run(
        [sys.executable, "-m", "unbroken", "render", "k8s", str(spec), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    files = sorted(out.glob("*.yaml"))
    crds = sorted((out / "monitoring").glob("*.yaml"))
    assert files[0].name.startswith("00-namespace") and len(crds) == 5
    for f in files:
        kubernetes_validate.validate(yaml.safe_load(f.read_text()), K8S, strict=True)
    bad = subprocess.run(
        [sys.executable, "-m", "unbroken", "render", "k8s", "--gateway-replicas", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert bad.returncode == 2 and "2 or more replicas" in bad.stderr


def test_dockerfile_shape() -> None:
    """No Docker daemon runs here to build it; what can be checked without one is."""
    root = Path(__file__).parent.parent
    text = (root / "Dockerfile").read_text()
    stages: dict[str, list[str]] = {}
    current = ""
    for line in text.splitlines():
        if line.startswith("FROM "):
            current = line.split(" AS ")[-1].strip()
            stages[current] = []
        elif current and not line.startswith("#"):
            stages[current].append(line)
    assert list(stages) == ["build", "base", "agent", "unbroken"]  # the last is the default
    base, agent = "\n".join(stages["base"]), "\n".join(stages["agent"])
    assert "USER 10001:10001" in base and "clang" not in base
    assert "clang" in agent and "bpftool" in agent
    steps = [x for x in stages["agent"] if x.strip()]
    assert steps[-1] == "USER 10001:10001"  # root only while installing
    assert "COPY --from=build /opt/venv /opt/venv" in base
    ignored = (root / ".dockerignore").read_text().split()
    assert {".git", ".venv", "tests"} <= set(ignored)


def test_seed_rules_match_the_standalone_file() -> None:
    """The PrometheusRule carries the same seed-compatible recording rules as the file for a
    Prometheus without the operator; they must not drift apart."""
    path = Path(__file__).parent.parent / "deploy" / "prometheus" / "recording-rules.yaml"
    groups = yaml.safe_load(path.read_text())["groups"]
    rule = by(render(default_spec(), RenderOptions()), "PrometheusRule")[0]["spec"]["groups"]

    def rules(gs: list[dict[str, Any]]) -> dict[str, str]:
        g = next(g for g in gs if g["name"] == "unbroken-agent-seed-compat")
        return {r["record"]: "".join(r["expr"].split()) for r in g["rules"]}

    assert rules(rule) == rules(groups)
