"""`unbroken render k8s`: every object valid against the Kubernetes 1.30 schema (strict,
offline, from the kubernetes-validate package), and the policy rules hold on the objects;
each rule is also shown to catch a broken object."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import orjson
import pytest
import yaml

from unbroken.config.spec import (
    EngineSpec,
    GatewaySettings,
    PipelineSpec,
    PoolSpec,
    default_spec,
    parse_spec,
)
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
        lambda o: o["rules"].append(
            {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["get", "patch"]}
        ),
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
    # Liveness is the process (vllm-router's /liveness), not /health, which answers 503
    # while the drain runs: a restart then would cut the streams it drains (a review).
    c = pod["containers"][0]
    assert c["livenessProbe"]["httpGet"]["path"] == "/liveness"
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert by(objs, "PodDisruptionBudget", "unbroken-gateway")[0]["spec"]["minAvailable"] == 1
    admin_svc = by(objs, "Service", "unbroken-gateway-admin")[0]
    assert admin_svc["spec"]["clusterIP"] == "None"
    cfg = yaml.safe_load(
        by(objs, "Secret", "unbroken-gateway-config")[0]["stringData"]["gateway.yaml"]
    )
    assert GatewaySettings.model_validate(cfg).drain_deadline_s == 12.5
    assert GatewaySettings.model_validate(cfg).endpoint_header is False  # no pod names leak
    ctl = by(objs, "Deployment", "unbroken-controller")[0]["spec"]["template"]["spec"]
    ctl_args = ctl["containers"][0]["args"]
    assert "--gateway-service" in ctl_args and "--agent-service" in ctl_args
    agent_svc = by(objs, "Service", "unbroken-agent")[0]
    assert agent_svc["spec"]["clusterIP"] == "None"
    secret = by(objs, "Secret", "unbroken-admin-token")[0]["stringData"]["token"]
    again = by(render(spec, RenderOptions()), "Secret", "unbroken-admin-token")[0]
    assert len(secret) >= 32 and again["stringData"]["token"] != secret
    # Every object that carries the token carries the same one.
    for d in by(objs, "Deployment"):
        notes = d["spec"]["template"]["metadata"]["annotations"]
        assert len(notes["checksum/config"]) == 64


def test_controller_reads_the_agent_service_where_it_lives() -> None:
    """The agent's Service is in NS-agent (parse_service_ref reads NAMESPACE/SERVICE), and the
    controller may read EndpointSlices there and in NS, nothing else (it asks the API for
    nothing else: no pods, no Deployments)."""
    from unbroken.k8s.discovery import parse_service_ref

    objs = render(custom_spec(), RenderOptions(namespace="llm"))
    ctl = by(objs, "Deployment", "unbroken-controller")[0]["spec"]["template"]["spec"]
    args = ctl["containers"][0]["args"]
    ref = parse_service_ref(args[args.index("--agent-service") + 1])
    svc = by(objs, "Service", "unbroken-agent")[0]["metadata"]
    assert (ref.namespace, ref.service) == (svc["namespace"], svc["name"])
    assert svc["namespace"] == "llm-agent" and ref.port == "metrics"
    roles = {r["metadata"]["namespace"]: r for r in by(objs, "Role", "unbroken-controller")}
    slices = [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["list", "watch"],
        }
    ]
    assert set(roles) == {"llm", "llm-agent"}
    assert all(r["rules"] == slices for r in roles.values())
    bindings = [b for b in by(objs, "RoleBinding", "unbroken-controller")]
    assert {b["metadata"]["namespace"] for b in bindings} == {"llm", "llm-agent"}
    for b in bindings:
        assert b["roleRef"]["name"] == "unbroken-controller"
        assert b["subjects"] == [
            {"kind": "ServiceAccount", "name": "unbroken-controller", "namespace": "llm"}
        ]


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


# -- engines: vLLM's own parser, pre-warm, spec fields -----------------------------------------
VLLM_PY = Path.home() / ".cache/unbroken/vllm-venv-0.32.0/bin/python"
# vLLM 0.32's own `vllm serve` parser on argument lists (stdin: a JSON list of them).
VLLM_PARSE = """
import json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
out = []
for argv in json.load(sys.stdin):
    a = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    out.append({
        "lora": [[m.name, m.path, m.base_model_name] for m in a.lora_modules or []],
        "served": a.served_model_name, "shutdown": a.shutdown_timeout,
        "tp": a.tensor_parallel_size, "port": a.port, "host": a.host,
    })
print(json.dumps(out))
"""


def edge_spec() -> PipelineSpec:
    """Every flag the render emits, LoRA names and paths vLLM's `name=path` form would
    misread, and a `kind: command` pool."""
    return parse_spec(
        {
            "model": "meta-llama/Llama-3.1-8B-Instruct",
            "pools": [
                {
                    "name": "llama",
                    "aliases": ["llama-8b"],
                    "precision": "fp8",
                    "engine": {"overrides": {"max_num_seqs": 64, "max_model_len": 8192}},
                    "adapters": [
                        {"name": "a=b", "path": "/models/loras/ab"},
                        {"name": "comma", "path": "/models/loras/x,y"},
                        {"name": "plain", "path": "/models/loras/p"},
                        {"name": "on-alias", "path": "org/l", "base": "llama-8b"},
                    ],
                },
                {
                    "name": "big",
                    "model": "meta-llama/Llama-3.1-70B-Instruct",
                    "weights": "/models/llama70",
                    "engine": {
                        "kind": "command",
                        "command": [
                            "vllm",
                            "serve",
                            "/models/llama70",
                            "--port",
                            "{port}",
                            "--served-model-name",
                            "{model}",
                            "--tensor-parallel-size",
                            "4",
                            "--gpu-memory-utilization=0.95",
                        ],
                    },
                },
            ],
        }
    )


def _engine_args(objs: list[dict[str, Any]], pool: str) -> list[str]:
    return engine_container(by(objs, "Deployment", f"unbroken-{pool}")[0])["args"]


def test_default_vllm_image_takes_every_flag() -> None:
    """The default image is vLLM 0.32 (0.11.0 exits 2 on --shutdown-timeout), and every
    rendered engine's flags parse with vLLM 0.32's own parser, LoRA entries as meant."""
    assert RenderOptions().vllm_image == "vllm/vllm-openai:v0.32.0"
    objs = render(edge_spec(), RenderOptions())
    for d in by(objs, "Deployment"):
        if d["metadata"]["labels"]["app.kubernetes.io/component"] == "engine":
            assert engine_container(d)["image"] == "vllm/vllm-openai:v0.32.0"
    llama, big = _engine_args(objs, "llama"), _engine_args(objs, "big")
    if not VLLM_PY.exists():
        pytest.skip(f"no vLLM 0.32 at {VLLM_PY}")
    argvs = [llama[1:], big[1:]]  # without `serve`: the subcommand's own parser
    p = subprocess.run(
        [str(VLLM_PY), "-c", VLLM_PARSE],
        input=orjson.dumps(argvs).decode(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    one, two = orjson.loads(p.stdout.strip().splitlines()[-1])
    assert one["lora"] == [
        ["a=b", "/models/loras/ab", None],
        ["comma", "/models/loras/x,y", None],
        ["plain", "/models/loras/p", None],
        ["on-alias", "org/l", "llama-8b"],
    ]
    assert one["served"] == ["meta-llama/Llama-3.1-8B-Instruct", "llama-8b"]
    assert one["shutdown"] == 30 and one["port"] == 8000
    assert two["tp"] == 4 and two["served"] == ["meta-llama/Llama-3.1-70B-Instruct"]
    assert two["port"] == 8000 and two["host"] == "0.0.0.0"


def test_lora_entries_read_back_as_written() -> None:
    """`name=path` only where vLLM's parser (the simulator's mirrors it) reads it back; an
    adapter on a base the pool does not serve is refused."""
    from unbroken.engine.lora import parse_lora_modules

    spec = edge_spec()
    args = _engine_args(render(spec, RenderOptions()), "llama")
    i = args.index("--lora-modules")
    mods = parse_lora_modules(args[i + 1 : i + 5])
    got = [(m.name, m.path) for m in mods]
    assert got == [(a.name, a.path) for a in spec.pools[0].adapters]
    assert args[i + 3] == "plain=/models/loras/p"
    bad = edge_spec()
    bad.pools[0].adapters[3].base = "gpt-4"
    with pytest.raises(ValueError, match=r"pools\.llama\.adapters\[3\]\.base: 'gpt-4'"):
        render(bad, RenderOptions())


def test_command_pool_renders_its_flags_and_gpus() -> None:
    objs = render(edge_spec(), RenderOptions())
    big = by(objs, "Deployment", "unbroken-big")[0]
    args = engine_container(big)["args"]
    assert args[:2] == ["serve", "/models/llama70"]
    assert args.count("--port") == 1 and args[args.index("--port") + 1] == "8000"
    assert args.count("--served-model-name") == 1
    assert args[args.index("--tensor-parallel-size") + 1] == "4"
    assert "--gpu-memory-utilization=0.95" in args or "0.95" in args
    res = engine_container(big)["resources"]
    assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"] == "4"
    assert check(objs) == []

    def with_command(*cmd: str) -> PipelineSpec:
        spec = edge_spec()
        spec.pools[1].engine.command = list(cmd)
        return spec

    refused = {
        "--max-num-seqs": with_command("vllm", "serve", "m", "--max-num-seqs", "8"),
        "only `vllm serve": with_command("python", "-m", "vllm.entrypoints.openai.api_server"),
        "--shutdown-timeout": with_command("vllm", "serve", "m", "--shutdown-timeout=5"),
    }
    for message, spec in refused.items():
        with pytest.raises(ValueError, match=r"pools\.big\.engine\.command") as e:
            render(spec, RenderOptions())
        assert message in str(e.value)


def test_prewarm_reads_its_own_pool_and_never_blocks_the_engine(tmp_path: Path) -> None:
    """Each pool pre-warms its own files (weights, or its model's folder in the HF cache)
    with `--target 0`: a residency shortfall, or nothing to read, leaves the engine to
    start. The rendered shell is run with the real `unbroken prewarm`."""
    spec = edge_spec()
    spec.pools.append(PoolSpec(name="qwen", model="Qwen/Qwen2.5-7B-Instruct"))
    objs = render(spec, RenderOptions())
    cmds = {}
    for pool in ("llama", "big", "qwen"):
        d = by(objs, "Deployment", f"unbroken-{pool}")[0]
        init = {c["name"]: c for c in d["spec"]["template"]["spec"]["initContainers"]}
        cmds[pool] = init["prewarm"]["command"][-1]
        # The page cache counts against the limit: the engine's, not 2Gi.
        assert init["prewarm"]["resources"]["limits"]["memory"] == "64Gi"
    assert "prewarm --target 0 /models/hf/hub/models--Qwen--Qwen2.5-7B-Instruct " in cmds["qwen"]
    assert "prewarm --target 0 /models/llama70 " in cmds["big"]
    assert "models--meta-llama--Llama-3.1-8B-Instruct" in cmds["llama"]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "unbroken").write_text(f'#!/bin/sh\nexec {sys.executable} -m unbroken "$@"\n')
    (bin_dir / "unbroken").chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)}
    models = tmp_path / "models"
    cmd = cmds["qwen"].replace("/models/", f"{models}/")

    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["sh", "-c", cmd], capture_output=True, text=True, env=env, timeout=60
        )

    first = run()  # an empty cache: vLLM downloads
    assert first.returncode == 0 and "vLLM downloads them" in first.stdout
    folder = models / "hf/hub/models--Qwen--Qwen2.5-7B-Instruct"
    folder.mkdir(parents=True)
    nothing = run()  # no weight files yet (a partial download): prewarm fails, logged only
    assert nothing.returncode == 0 and "pre-warm incomplete" in nothing.stdout
    snap = folder / "snapshots/abc"
    snap.mkdir(parents=True)
    (snap / "model.safetensors").write_bytes(b"\0" * 65536)
    (models / "other.safetensors").write_bytes(b"\0" * 4096)  # another pool's
    done = run()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "model.safetensors" in done.stdout and "other" not in done.stdout
    assert "incomplete" not in done.stdout


def test_engine_env_and_api_key_from_a_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """`engine.env` and the pool's API key reach the engine (VLLM_API_KEY, which vLLM reads
    as --api-key), its readiness probe and the gateway (`upstream_key_env`), all through
    the pool's Secret; `api_key_env` is read where the render runs."""
    from unbroken.gateway._headers import Headers

    spec = parse_spec(
        {
            "model": "m/x",
            "pools": [
                {"name": "primary", "api_key": "engine-secret-123"},
                {
                    "name": "other",
                    "api_key_env": "VLLM_KEY",
                    "engine": {"env": {"HF_TOKEN": "hf_x"}},
                },
                {"name": "plain"},
            ],
        }
    )
    monkeypatch.delenv("VLLM_KEY", raising=False)
    with pytest.raises(ValueError, match=r"pools\.other\.api_key_env: VLLM_KEY is not set"):
        render(spec, RenderOptions())
    monkeypatch.setenv("VLLM_KEY", "other-key-456")
    objs = render(spec, RenderOptions())
    for o in objs:
        if o["kind"] != "Secret":
            text = yaml.safe_dump(o)
            assert "engine-secret-123" not in text and "other-key-456" not in text
            assert "hf_x" not in text
    assert by(objs, "Secret", "unbroken-primary-engine")[0]["stringData"] == {
        "api-key": "engine-secret-123"
    }
    assert by(objs, "Secret", "unbroken-other-engine")[0]["stringData"] == {
        "env.HF_TOKEN": "hf_x",
        "api-key": "other-key-456",
    }
    assert not by(objs, "Secret", "unbroken-plain-engine")

    def env(c: dict[str, Any]) -> dict[str, Any]:
        return {e["name"]: e.get("valueFrom", e.get("value")) for e in c["env"]}

    other = engine_container(by(objs, "Deployment", "unbroken-other")[0])
    ref = {"secretKeyRef": {"name": "unbroken-other-engine", "key": "env.HF_TOKEN"}}
    assert env(other)["HF_TOKEN"] == ref
    key = {"secretKeyRef": {"name": "unbroken-other-engine", "key": "api-key"}}
    assert env(other)["VLLM_API_KEY"] == key
    ready = other["readinessProbe"]["exec"]["command"]
    assert ready[ready.index("--api-key-env") + 1] == "VLLM_API_KEY"
    plain = engine_container(by(objs, "Deployment", "unbroken-plain")[0])
    assert "VLLM_API_KEY" not in env(plain)
    assert "--api-key-env" not in plain["readinessProbe"]["exec"]["command"]
    gw = by(objs, "Deployment", "unbroken-gateway")[0]["spec"]["template"]["spec"]["containers"][0]
    assert env(gw)["UNBROKEN_POOL_KEY_OTHER"] == key
    cfg = GatewaySettings.model_validate(
        yaml.safe_load(
            by(objs, "Secret", "unbroken-gateway-config")[0]["stringData"]["gateway.yaml"]
        )
    )
    assert cfg.upstream_key_env == {
        "primary": "UNBROKEN_POOL_KEY_PRIMARY",
        "other": "UNBROKEN_POOL_KEY_OTHER",
    }
    # The gateway's own reading of them, with the variables the pod gets from the Secret.
    monkeypatch.setenv("UNBROKEN_POOL_KEY_PRIMARY", "engine-secret-123")
    monkeypatch.setenv("UNBROKEN_POOL_KEY_OTHER", "other-key-456")
    assert Headers(cfg).pool_keys == {"primary": "engine-secret-123", "other": "other-key-456"}
    clash = parse_spec({"pools": [{"name": "a", "engine": {"env": {"HF_HOME": "/x"}}}]})
    with pytest.raises(ValueError, match=r"pools\.a\.engine\.env\.HF_HOME: set by the render"):
        render(clash, RenderOptions())


def test_ready_hook_sends_the_engine_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """The readiness probe of an engine with --api-key authenticates its warm-up (vLLM
    answers 401 on /v1 without it; /health is open)."""
    import http.server
    import threading

    from unbroken.k8s import hooks

    seen: list[str | None] = []

    class Engine(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a: Any) -> None:
            pass

        def _answer(self) -> None:
            auth = self.headers.get("Authorization")
            seen.append(auth)
            ok = self.path == "/health" or auth == "Bearer k-1"
            body = b'{"data": [{"id": "m"}]}' if ok else b"{}"
            self.send_response(200 if ok else 401)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            self._answer()

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self._answer()

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Engine)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_port}"
    try:
        assert hooks.main(["ready", "--url", url, "--model", "m"]) == 1
        monkeypatch.setenv("VLLM_API_KEY", "k-1")
        argv = ["ready", "--url", url, "--model", "m", "--api-key-env", "VLLM_API_KEY"]
        assert hooks.main(argv) == 0
        assert seen[-1] == "Bearer k-1"
    finally:
        srv.shutdown()


# -- names, monitoring, re-rendering -----------------------------------------------------------
@pytest.mark.parametrize(
    ("spec", "opts", "message"),
    [
        (
            {"pools": [{"name": "a" * 55}]},
            {},
            r"pools\.a+: the pool's Service name .* 64 characters, over the 63",
        ),
        ({"pools": [{"name": "p"}]}, {"namespace": "n" * 58}, r"at most 57 characters"),
        ({"pools": [{"name": "p"}]}, {"namespace": "My_NS"}, r"namespace 'My_NS'"),
    ],
)
def test_names_the_api_server_would_refuse(
    spec: dict[str, Any], opts: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        render(parse_spec(spec), RenderOptions(**opts))


def test_longest_names_that_fit_render() -> None:
    objs = render(parse_spec({"pools": [{"name": "a" * 54}]}), RenderOptions(namespace="n" * 57))
    names = [o["metadata"]["name"] for o in by(objs, "Service")]
    assert max(len(n) for n in names) == 63
    assert {o["metadata"]["name"] for o in by(objs, "Namespace")} == {"n" * 57, "n" * 57 + "-agent"}


def test_pod_monitors_keep_the_series_own_labels() -> None:
    """The agent's `pod`/`namespace`/`container` and everyone's `endpoint` are the series'
    own, which the rules group by: prometheus-operator's target labels must not rename them
    to `exported_*`. `--monitor-label` adds the label a Prometheus selects them by."""
    objs = render(default_spec(), RenderOptions(monitor_labels=(("release", "kps"),)))
    mons = {o["metadata"]["name"]: o for o in by(objs, "PodMonitor")}
    for name in ("unbroken-agent", "unbroken-controller", "unbroken-gateway"):
        (ep,) = mons[name]["spec"]["podMetricsEndpoints"]
        assert ep["honorLabels"] is True, name
    for o in [*mons.values(), *by(objs, "PrometheusRule")]:
        assert o["metadata"]["labels"]["release"] == "kps"
    rules = yaml.safe_dump(by(objs, "PrometheusRule")[0]["spec"])
    assert "exported_" not in rules and "by (endpoint" in rules


def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "unbroken", "render", "k8s", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
    )


def test_rerender_replaces_its_own_files_and_keeps_the_token(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(custom_spec().model_dump(mode="json")))
    out = tmp_path / "out"
    assert _cli(str(spec), "--out", str(out)).returncode == 0
    first = {p.name: p.read_text() for p in out.rglob("*.yaml")}
    assert any("unbroken-big" in n for n in first)
    p = _cli("--out", str(out))  # the default spec: pools primary and fallback
    assert p.returncode == 0, p.stderr
    now = {p.name: p.read_text() for p in out.rglob("*.yaml")}
    assert not any("unbroken-big" in n or "unbroken-small" in n for n in now)
    assert not any("unbroken-big" in t for t in now.values())

    def token(files: dict[str, str]) -> str:
        (text,) = [t for n, t in files.items() if n.endswith("-secret-unbroken-admin-token.yaml")]
        return str(yaml.safe_load(text)["stringData"]["token"])

    assert token(now) == token(first)
    again = _cli("--out", str(out))
    assert again.returncode == 0
    assert {p.name: p.read_text() for p in out.rglob("*.yaml")} == now  # stable

    # A directory with other files is refused and left as it was.
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "kustomization.yaml").write_text("resources: []\n")
    bad = _cli("--out", str(mine))
    assert bad.returncode == 2 and "did not write" in bad.stderr
    assert [p.name for p in mine.iterdir()] == ["kustomization.yaml"]
    dash = _cli("--out", "-", cwd=tmp_path)
    assert dash.returncode == 2 and not (tmp_path / "-").exists()


def test_changed_config_rolls_the_pods() -> None:
    """`checksum/config` on each pod template follows what its pods read from Secrets."""

    def sums(spec: PipelineSpec, token: str) -> dict[str, str]:
        objs = render(spec, RenderOptions(admin_token=token))
        return {
            d["metadata"]["name"]: d["spec"]["template"]["metadata"]["annotations"][
                "checksum/config"
            ]
            for d in by(objs, "Deployment")
        }

    base = sums(default_spec(), "t-1")
    assert sums(default_spec(), "t-1") == base
    other = default_spec()
    other.gateway.priority_keys = {"sk-1": "critical"}
    changed = sums(other, "t-1")
    assert changed["unbroken-gateway"] != base["unbroken-gateway"]
    assert changed["unbroken-controller"] == base["unbroken-controller"]
    rotated = sums(default_spec(), "t-2")
    assert all(rotated[n] != base[n] for n in base)


def test_startup_probe_covers_the_pools_health_timeout() -> None:
    """A pool whose engine may take longer than the default 30 min to answer /health (a large
    model on slow storage: `engine.health_timeout_s`) must not be killed by its liveness
    probe while it loads."""
    spec = parse_spec(
        {
            "model": "m",
            "pools": [
                {"name": "primary"},
                {"name": "slow", "engine": {"health_timeout_s": 3600}},
            ],
        }
    )
    probes = {
        o["metadata"]["name"]: o["spec"]["template"]["spec"]["containers"][0]["startupProbe"]
        for o in render(spec, RenderOptions())
        if o["kind"] == "Deployment"
        and o["metadata"]["name"] in ("unbroken-primary", "unbroken-slow")
    }
    budget = {k: p["periodSeconds"] * p["failureThreshold"] for k, p in probes.items()}
    assert budget == {"unbroken-primary": 1800, "unbroken-slow": 3600}


def test_vllm_cautions_name_what_renders_but_cannot_start(tmp_path: Path) -> None:
    """A review of the rendered example: an adapter path on no volume of the engine pod
    (vLLM fails to start on a missing --lora-modules path) and the simulator's model name
    given to `vllm serve` render without a word; `unbroken render k8s` now warns of both."""
    from unbroken.config.spec import parse_spec
    from unbroken.k8s.render import vllm_cautions

    spec = parse_spec(
        {
            "model": "meta-llama/Llama-3.1-8B-Instruct",
            "pools": [
                {"name": "a", "adapters": {"x": "/adapters/x", "y": "/models/adapters/y"}},
                {"name": "b", "model": "unbroken-sim", "adapters": ["org/hub-adapter"]},
            ],
        }
    )
    said = vllm_cautions(spec)
    assert len(said) == 2, said
    assert said[0].startswith("pool a: adapter x's path /adapters/x is on no volume"), said
    assert said[1].startswith("pool b: `vllm serve unbroken-sim`"), said
    # The command says it (the default spec's model is the simulator's).
    r = subprocess.run(
        [sys.executable, "-m", "unbroken", "render", "k8s", "--out", str(tmp_path / "k8s")],
        capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "300"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "warning: pool primary: `vllm serve unbroken-sim`" in r.stdout + r.stderr, r.stdout


def test_runtime_class_goes_on_the_vllm_pods_only() -> None:
    """Stock k3s keeps runc as its default runtime and registers the GPU one as RuntimeClass
    `nvidia` (a review: no way to say so in the render): `--runtime-class` sets the engine
    pods' `runtimeClassName`; nothing else gets it, and without it nothing has it."""
    spec = default_spec()
    plain = render(spec, RenderOptions())
    assert not any("runtimeClassName" in str(o) for o in plain)
    objs = render(spec, RenderOptions(runtime_class="nvidia"))
    engines = [
        o
        for o in objs
        if o["kind"] == "Deployment"
        and o["metadata"]["labels"].get("app.kubernetes.io/component") == "engine"
    ]
    assert len(engines) == len(spec.pools), [o["metadata"]["name"] for o in objs]
    assert all(o["spec"]["template"]["spec"]["runtimeClassName"] == "nvidia" for o in engines)
    others = [o for o in objs if o not in engines]
    assert not any("runtimeClassName" in str(o) for o in others)


def test_out_of_rotation_and_pool_down_alerts_fire_as_written(tmp_path: Path) -> None:
    """The rendered alerts on the gateway's endpoint series, evaluated by Prometheus's own
    engine (`promtool test rules`): a ready replica failing its health checks for 5 min
    fires UnbrokenEndpointOutOfRotation (a draining one does not), a pool with no healthy
    replica for 1 min fires UnbrokenPoolDown (a pool with one left does not). An SRE review
    found nothing to alert on for either."""
    if shutil.which("promtool") is None:
        pytest.fail("promtool is installed by scripts/bootstrap.sh; it is missing here")
    rule = by(render(default_spec(), RenderOptions()), "PrometheusRule")[0]["spec"]
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump(rule))
    h, s = "unbroken_gateway_endpoint_healthy", "unbroken_gateway_endpoint_state"
    series = [
        # a-1 ready and failing; a-2 draining and failing: pool a has none healthy
        {"series": f'{h}{{endpoint="a-1",pool="a"}}', "values": "0x10"},
        {"series": f'{s}{{endpoint="a-1",pool="a",state="ready"}}', "values": "1x10"},
        {"series": f'{h}{{endpoint="a-2",pool="a"}}', "values": "0x10"},
        {"series": f'{s}{{endpoint="a-2",pool="a",state="ready"}}', "values": "0x10"},
        {"series": f'{s}{{endpoint="a-2",pool="a",state="draining"}}', "values": "1x10"},
        # pool b: one of two healthy
        {"series": f'{h}{{endpoint="b-1",pool="b"}}', "values": "1x10"},
        {"series": f'{s}{{endpoint="b-1",pool="b",state="ready"}}', "values": "1x10"},
        {"series": f'{h}{{endpoint="b-2",pool="b"}}', "values": "0x10"},
        {"series": f'{s}{{endpoint="b-2",pool="b",state="ready"}}', "values": "1x10"},
    ]
    summary = {
        r["alert"]: r["annotations"]["summary"] for g in rule["groups"] for r in g["rules"]
        if "alert" in r
    }  # fmt: skip

    def firing(alert: str, **labels: str) -> dict[str, Any]:
        text = summary[alert]
        for k, v in labels.items():
            text = text.replace("{{ $labels.%s }}" % k, v)  # noqa: UP031
        sev = "critical" if alert == "UnbrokenPoolDown" else "warning"
        return {"exp_labels": {"severity": sev, **labels}, "exp_annotations": {"summary": text}}

    down = [firing("UnbrokenPoolDown", pool="a")]
    out = [firing("UnbrokenEndpointOutOfRotation", endpoint=e, pool=p)
           for e, p in (("a-1", "a"), ("b-2", "b"))]  # fmt: skip
    tests = {
        "rule_files": [str(rules)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": series,
                "alert_rule_test": [
                    {"eval_time": "2m", "alertname": "UnbrokenPoolDown", "exp_alerts": down},
                    {"eval_time": "3m", "alertname": "UnbrokenEndpointOutOfRotation",
                     "exp_alerts": []},
                    {"eval_time": "6m", "alertname": "UnbrokenEndpointOutOfRotation",
                     "exp_alerts": out},
                ],
            }
        ],
    }  # fmt: skip
    path = tmp_path / "tests.yaml"
    path.write_text(yaml.safe_dump(tests))
    p = subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
