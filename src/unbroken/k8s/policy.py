"""The rules every rendered object set must keep, checked on the objects themselves (not on
the options that made them), so a hand edit or a new builder that breaks one is caught.
`render` refuses to write objects that break a rule; the tests check the same function can
fail on each rule."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from unbroken.k8s.manifests import AGENT_CAPABILITIES, GRACE_MARGIN_S, HOOK_MARGIN_S

__all__ = ["check"]

Obj = dict[str, Any]
WORKLOADS = ("Deployment", "DaemonSet", "StatefulSet", "Job")
AUTOSCALERS = ("ScaledObject", "HorizontalPodAutoscaler")
AGENT_ALLOWED = {*AGENT_CAPABILITIES, "SYS_RESOURCE"}


def _component(o: Obj) -> str:
    return o["metadata"].get("labels", {}).get("app.kubernetes.io/component", "")


def _containers(pod: Obj) -> Iterator[tuple[str, Obj]]:
    for c in pod.get("initContainers", []):
        yield "init", c
    for c in pod.get("containers", []):
        yield "main", c


def _arg(cmd: list[str], flag: str) -> float | None:
    try:
        return float(cmd[cmd.index(flag) + 1])
    except (ValueError, IndexError):
        return None


def check(objs: list[Obj]) -> list[str]:
    """Every broken rule, as `Kind/name: what`; empty when all hold."""
    bad: list[str] = []
    kinds = {(o["kind"], o["metadata"]["name"]): o for o in objs}
    for o in objs:
        where = f"{o['kind']}/{o['metadata']['name']}"
        if o["kind"] in WORKLOADS:
            bad += [f"{where}: {m}" for m in _workload(o)]
        if o["kind"] in ("Role", "ClusterRole"):
            bad += [f"{where}: {m}" for m in _rbac(o)]
    gateways = [o for o in objs if o["kind"] == "Deployment" and _component(o) == "gateway"]
    if not gateways:
        bad.append("no gateway Deployment")
    for gw in gateways:
        sel = gw["spec"]["selector"]["matchLabels"]
        if gw["spec"]["replicas"] < 2:
            bad.append(f"Deployment/{gw['metadata']['name']}: fewer than 2 gateway replicas")
        if not any(
            o["kind"] == "PodDisruptionBudget" and o["spec"]["selector"]["matchLabels"] == sel
            for o in objs
        ):
            bad.append(f"Deployment/{gw['metadata']['name']}: no PodDisruptionBudget")
    for (kind, name), o in kinds.items():
        if kind == "Deployment" and _component(o) == "engine" and ("Service", name) not in kinds:
            bad.append(f"Deployment/{name}: no Service (the gateway discovers engines by it)")
    bad += _autoscalers(objs, kinds)
    return bad


def _autoscalers(objs: list[Obj], kinds: dict[tuple[str, str], Obj]) -> Iterator[str]:
    """An autoscaler scales an engine Deployment of this set, alone, and that Deployment
    leaves `replicas` to it: with `replicas` set, every `kubectl apply` would reset the
    count the autoscaler chose (a grown pool drained back to one number, then grown again)."""
    owners: dict[str, str] = {}
    for o in objs:
        if o["kind"] not in AUTOSCALERS:
            continue
        where = f"{o['kind']}/{o['metadata']['name']}"
        ref = o["spec"].get("scaleTargetRef", {})
        target = kinds.get(("Deployment", ref.get("name", "")))
        if ref.get("kind", "Deployment") != "Deployment" or target is None:
            yield f"{where}: scales {ref.get('kind')}/{ref.get('name')}, not a Deployment here"
            continue
        if _component(target) != "engine":
            yield f"{where}: scales a Deployment that is not an engine pool"
        if "replicas" in target["spec"]:
            yield f"{where}: Deployment/{ref['name']} sets replicas (apply would fight it)"
        if ref["name"] in owners:
            yield f"{where}: Deployment/{ref['name']} already scaled by {owners[ref['name']]}"
        owners[ref["name"]] = where
        s = o["spec"]
        lo = s.get("minReplicaCount", s.get("minReplicas", 1))
        hi = s.get("maxReplicaCount", s.get("maxReplicas", 100))
        if lo > hi:
            yield f"{where}: min {lo} > max {hi}"


def _workload(o: Obj) -> Iterator[str]:
    comp = _component(o)
    pod = o["spec"]["template"]["spec"]
    pod_sc = pod.get("securityContext", {})
    if pod.get("hostNetwork") or pod.get("hostIPC"):
        yield "host network/IPC namespace"
    if pod.get("hostPID") and comp != "agent":
        yield "hostPID outside the agent"
    for kind, c in _containers(pod):
        name = c["name"]
        sc = c.get("securityContext", {})
        if sc.get("privileged", False):
            yield f"{name}: privileged"
        if sc.get("allowPrivilegeEscalation", True):
            yield f"{name}: allowPrivilegeEscalation not false"
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            yield f"{name}: capabilities not dropped (drop: [ALL])"
        added = set(caps.get("add", []))
        if comp == "agent":
            if not {"BPF", "PERFMON"} <= added:
                yield f"{name}: the agent needs BPF and PERFMON"
            if added - AGENT_ALLOWED:
                yield f"{name}: capabilities beyond the minimum: {sorted(added - AGENT_ALLOWED)}"
        elif added:
            yield f"{name}: adds capabilities {sorted(added)}"
        res = c.get("resources", {})
        if not {"cpu", "memory"} <= set(res.get("requests", {})):
            yield f"{name}: no cpu/memory requests"
        if "memory" not in res.get("limits", {}):
            yield f"{name}: no memory limit"
        if kind == "main" and not ("readinessProbe" in c and "livenessProbe" in c):
            yield f"{name}: readiness and liveness probes required"
        if comp == "gateway":
            non_root = sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))
            if not non_root:
                yield f"{name}: gateway not runAsNonRoot"
            if not sc.get("readOnlyRootFilesystem"):
                yield f"{name}: gateway root filesystem not read-only"
            token = [e for e in c.get("env", []) if e["name"] == "UNBROKEN_ADMIN_TOKEN"]
            if not token or "secretKeyRef" not in token[0].get("valueFrom", {}):
                yield f"{name}: admin token not from a Secret"
    if comp == "engine":
        yield from _engine(o, pod)


def _engine(o: Obj, pod: Obj) -> Iterator[str]:
    strat = o["spec"].get("strategy", {})
    ru = strat.get("rollingUpdate", {})
    if strat.get("type") != "RollingUpdate" or ru.get("maxSurge") != 1:
        yield "engine rollout must be RollingUpdate with maxSurge 1"
    if ru.get("maxUnavailable") != 0:
        yield "engine rollout must have maxUnavailable 0"
    (c,) = [c for c in pod["containers"] if c["name"] == "engine"]
    pre = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    if "drain" not in pre:
        yield "engine preStop does not drain through the gateway"
    ready = c.get("readinessProbe", {}).get("exec", {}).get("command", [])
    if "ready" not in ready or "--budget-ms" not in ready:
        yield "engine readiness is not the two-stage check"
    names = {n for _, x in _containers(pod) for n in [x["name"]]}
    if "prewarm" not in names:
        yield "no prewarm initContainer"
    mounts = {m["mountPath"] for m in c.get("volumeMounts", [])}
    if "/dev/shm" not in mounts:
        yield "no /dev/shm volume"
    deadline, hook_timeout = _arg(pre, "--deadline"), _arg(pre, "--timeout")
    shutdown = _arg(c.get("args", []), "--shutdown-timeout")
    if deadline is None or hook_timeout is None or shutdown is None:
        yield "preStop --deadline/--timeout or engine --shutdown-timeout missing"
        return
    grace = pod.get("terminationGracePeriodSeconds", 30)
    need = deadline + HOOK_MARGIN_S + shutdown + GRACE_MARGIN_S
    if grace < need:
        yield f"terminationGracePeriodSeconds {grace} < {need:g} (grace rule)"
    if hook_timeout > deadline + HOOK_MARGIN_S:
        yield f"preStop may run {hook_timeout:g} s, past its share of the grace period"


def _rbac(o: Obj) -> Iterator[str]:
    for rule in o.get("rules", []):
        if "*" in rule.get("verbs", []) or "*" in rule.get("resources", []):
            yield "wildcard in a rule"
        writes = set(rule.get("verbs", [])) - {"get", "list", "watch"}
        if writes:
            if rule.get("resources") != ["deployments"] or writes - {"patch"}:
                yield f"write verbs {sorted(writes)} on {rule.get('resources')}"
            elif not rule.get("resourceNames"):
                yield "patch on deployments not limited by resourceNames"
        if "secrets" in rule.get("resources", []):
            yield "reads secrets"
