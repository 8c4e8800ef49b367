"""Autoscaling on a cluster through Kubernetes' own autoscalers (issue 24): a KEDA
`ScaledObject` per pool with a replica range, or, for clusters without KEDA, an
`autoscaling/v2` HorizontalPodAutoscaler on an External metric served by prometheus-adapter.

Both scale on the signal the local autoscaler uses, the gateway's
`unbroken_gateway_pool_demand{pool}` (streams in flight on the pool plus requests queued for
it, per gateway process), summed over gateway pods: desired = ceil(sum / scaling.target), the
HPA's `AverageValue` rule. Scale-in deletes a pod, whose preStop hook drains it through every
gateway with a deadline and migrates what is left (manifests.py, hooks.py); nothing here
stops an engine by itself.

Pure functions of the spec: manifests.py passes metadata and names in, so this module does
not import it (manifests.build() imports this one).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import yaml

from unbroken.config.spec import PipelineSpec, PoolSpec, ScalingSpec

__all__ = [
    "AUTOSCALERS",
    "DEMAND_METRIC",
    "KEDA_API",
    "adapter_rule",
    "adapter_rules",
    "autoscale_cautions",
    "autoscaled",
    "behavior",
    "demand_query",
    "drain_deadline",
    "horizontal_pod_autoscaler",
    "scaled_object",
    "spill_chain",
    "wanted_query",
]

Obj = dict[str, Any]

AUTOSCALERS = ("keda", "hpa", "none")
DEMAND_METRIC = "unbroken_gateway_pool_demand"
KEDA_API = "keda.sh/v1alpha1"
# The HPA API's bounds (autoscaling/v2 validation): periodSeconds in [1, 1800],
# stabilizationWindowSeconds in [0, 3600].
_PERIOD_MAX = 1800
_WINDOW_MAX = 3600
# How many failed reads of the signal before KEDA's fallback applies (see scaled_object).
FALLBACK_FAILURES = 3


def autoscaled(pool: PoolSpec, autoscaler: str) -> bool:
    """Whether the pool gets an autoscaler object: it has a range and one was asked for."""
    if autoscaler not in AUTOSCALERS:
        raise ValueError(f"autoscaler must be one of {', '.join(AUTOSCALERS)}, not {autoscaler!r}")
    return pool.autoscale is not None and autoscaler != "none"


def drain_deadline(spec: PipelineSpec, pool: PoolSpec) -> float:
    """The preStop drain's deadline for the pool's pods.

    An autoscaled pool's pods leave by scale-in or by rollout, and a pod cannot tell which:
    it takes the longer of the two deadlines. Never shorter than the gateway's own, because
    the EndpointSlice's `terminating` may reach a gateway before the preStop call and then
    the gateway drains with `gateway.drain_deadline_s`; the hook (timeout = deadline + 5 s)
    must outlast that drain, or SIGTERM would cut the streams it still holds."""
    d = spec.gateway.drain_deadline_s
    if pool.autoscale is not None:
        d = max(d, pool.scaling.drain_deadline_s)
    return d


def demand_query(namespace: str, pool: str) -> str:
    """PromQL of the pool's demand over every gateway pod (and every worker: each pod's
    /metrics already sums its workers). `namespace` is the label the Prometheus Operator's
    PodMonitor adds, so that two pipelines with the same pool names do not add up."""
    return f'sum({DEMAND_METRIC}{{namespace="{namespace}",pool="{pool}"}})'


def spill_chain(spec: PipelineSpec, pool: PoolSpec) -> list[PoolSpec]:
    """The autoscaled pools whose overflow reaches `pool`, first to last, then `pool`: as the
    local autoscaler chains them (controller/scaling.py), each pool spills into the next
    pool of the same model in spec order, where both are autoscaled."""
    pools = list(spec.pools)
    chain = [pool]
    while True:
        i = next(k for k, p in enumerate(pools) if p.name == chain[0].name)
        model = chain[0].model_of(spec)
        prev = next((p for p in reversed(pools[:i]) if p.model_of(spec) == model), None)
        if prev is None or prev.autoscale is None or chain[0].autoscale is None:
            return chain
        chain.insert(0, prev)


def wanted_query(namespace: str, spec: PipelineSpec, pool: PoolSpec) -> str:
    """PromQL of the demand the pool is sized for: its own, plus what the pools before it
    in its spill chain cannot hold at their `max` (demand above max x cap, never below 0).
    Without it a same-model fallback at `min: 0` would never wake on a cluster: while it
    has no replica, the gateway counts the requests queued for its model toward the first
    pool of their route, the full primary (gateway/_admission.py, `_wants`), and the
    fallback's own demand stays 0 (the local autoscaler spills the same way,
    controller/autoscale.py). The room is max x cap, not max x target: the gateway moves
    a request to a later pool only when every replica of the first holds its cap, so
    demand above max x target but under max x cap would wake a fallback that then gets
    nothing (a review: a GPU node and a vLLM start for no request)."""
    chain = spill_chain(spec, pool)
    q = demand_query(namespace, chain[0].name)
    for prev, nxt in itertools.pairwise(chain):
        a = prev.autoscale
        assert a is not None
        room = a.max * spec.pool_cap(prev)
        q = f"{demand_query(namespace, nxt.name)} + clamp_min({q} - {room:g}, 0)"
    return q


def _seconds(x: float, lo: int, hi: int) -> int:
    return min(hi, max(lo, math.ceil(x)))


def behavior(s: ScalingSpec, max_replicas: int) -> Obj:
    """The HPA `behavior` for the spec's scaling settings.

    Down: the highest recommendation of the last `down_quiet_s` wins (the quiet period), then
    one pod per `down_cooldown_s`. Up: no stabilization, and whichever of "double" and "jump
    straight to max" allows more, so a burst that needs three more replicas gets them in one
    step (the HPA's own answer, ceil(demand / target), is proportional; the policies only
    limit it). Periods are clamped to the API's bounds (at least 1 s)."""
    return {
        "scaleDown": {
            "stabilizationWindowSeconds": _seconds(s.down_quiet_s, 0, _WINDOW_MAX),
            "selectPolicy": "Min",
            "policies": [
                {
                    "type": "Pods",
                    "value": 1,
                    "periodSeconds": _seconds(s.down_cooldown_s, 1, _PERIOD_MAX),
                }
            ],
        },
        "scaleUp": {
            "stabilizationWindowSeconds": 0,
            "selectPolicy": "Max",
            "policies": [
                {
                    "type": "Percent",
                    "value": 100,
                    "periodSeconds": _seconds(s.up_cooldown_s, 1, _PERIOD_MAX),
                },
                {
                    "type": "Pods",
                    "value": max_replicas,
                    "periodSeconds": _seconds(s.up_cooldown_s, 1, _PERIOD_MAX),
                },
            ],
        },
    }


def _target(s: ScalingSpec) -> str:
    """A target as the APIs take it: a plain number (KEDA) or a quantity (HPA); `g` keeps
    48.0 as "48" and 0.5 as "0.5", both valid quantities."""
    return f"{s.target:g}"


def scaled_object(
    meta: Obj,
    spec: PipelineSpec,
    pool: PoolSpec,
    *,
    target: str,
    namespace: str,
    prometheus_url: str,
    scrape_s: int,
) -> Obj:
    """A KEDA ScaledObject for one pool's Deployment `target`.

    KEDA creates and owns the HPA (named `keda-hpa-<name>`) from `advanced`, and does the
    0 <-> 1 step itself, which an HPA cannot: `pollingInterval` is how often it reads the
    signal while the pool is at 0 (the PodMonitor's scrape interval: reading faster sees
    the same sample), `cooldownPeriod` how long the signal must stay at 0 before 1 -> 0
    (the spec's quiet period). `ignoreNullValues: false`: an empty query result (no gateway
    scraped) is an error, not zero demand, so a lost signal never scales a pool in; after
    FALLBACK_FAILURES failures the fallback keeps the current count, or wakes the pool to
    max(1, min) if it was below that."""
    a = pool.autoscale
    assert a is not None
    s = pool.scaling
    return {
        "apiVersion": KEDA_API,
        "kind": "ScaledObject",
        "metadata": meta,
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": target},
            "minReplicaCount": a.min,
            "maxReplicaCount": a.max,
            "pollingInterval": scrape_s,
            "cooldownPeriod": _seconds(s.down_quiet_s, 0, 2**31 - 1),
            "fallback": {
                "failureThreshold": FALLBACK_FAILURES,
                "replicas": max(1, a.min),
                "behavior": "currentReplicasIfHigher",
            },
            "advanced": {
                "horizontalPodAutoscalerConfig": {"behavior": behavior(s, a.max)},
            },
            "triggers": [
                {
                    "type": "prometheus",
                    "name": "pool-demand",
                    "metricType": "AverageValue",
                    "metadata": {
                        "serverAddress": prometheus_url,
                        "query": wanted_query(namespace, spec, pool),
                        "threshold": _target(s),
                        # Active (0 -> 1) as soon as one request waits for the pool.
                        "activationThreshold": "0",
                        "ignoreNullValues": "false",
                    },
                }
            ],
        },
    }


def horizontal_pod_autoscaler(meta: Obj, pool: PoolSpec, *, target: str) -> Obj:
    """An autoscaling/v2 HPA on the External metric prometheus-adapter serves from
    `adapter_rules`. `minReplicas` is at least 1: a plain HPA cannot scale from 0 (the
    HPAScaleToZero feature gate is alpha), so `min: 0` needs KEDA."""
    a = pool.autoscale
    assert a is not None
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": meta,
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": target},
            "minReplicas": max(1, a.min),
            "maxReplicas": a.max,
            "metrics": [
                {
                    "type": "External",
                    "external": {
                        "metric": {
                            "name": DEMAND_METRIC,
                            "selector": {"matchLabels": {"pool": pool.name}},
                        },
                        "target": {"type": "AverageValue", "averageValue": _target(pool.scaling)},
                    },
                }
            ],
            "behavior": behavior(pool.scaling, a.max),
        },
    }


def adapter_rule() -> Obj:
    """prometheus-adapter's external rule for the demand gauge. The adapter adds the HPA's
    namespace (the `namespace` override) and the HPA's selector (`pool=...`) to
    `LabelMatchers`, so the query is the same sum KEDA's trigger runs."""
    return {
        "seriesQuery": f'{DEMAND_METRIC}{{namespace!="",pool!=""}}',
        "resources": {"overrides": {"namespace": {"resource": "namespace"}}},
        "name": {"matches": f"^{DEMAND_METRIC}$", "as": DEMAND_METRIC},
        "metricsQuery": "sum by (pool) (<<.Series>>{<<.LabelMatchers>>})",
    }


def adapter_rules(meta: Obj) -> Obj:
    """A ConfigMap carrying the rule twice: `config.yaml`, a prometheus-adapter config file
    (its `--config`), and `values.yaml`, the same rule for the prometheus-adapter Helm chart
    (`rules.external`). The adapter runs in its own namespace and reads its own ConfigMap:
    merge one of these into it (docs/kubernetes.md); this object only carries the text."""
    rule = adapter_rule()
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta,
        "data": {
            "config.yaml": yaml.safe_dump({"externalRules": [rule]}, sort_keys=False),
            "values.yaml": yaml.safe_dump({"rules": {"external": [rule]}}, sort_keys=False),
        },
    }


def autoscale_cautions(
    spec: PipelineSpec, *, autoscaler: str, engine: str, scrape_s: int
) -> list[str]:
    """What the render changes or cannot keep of the spec's autoscaling, said at render
    rather than found on the cluster (a review): a `min: 0` the chosen autoscaler cannot
    keep; a sleeping vLLM pool whose first requests would time out in the gateway's queue
    before it wakes; scaling periods the HPA's API bounds cut."""
    out: list[str] = []
    for pool in spec.pools:
        a = pool.autoscale
        if a is None:
            continue
        if a.min == 0 and autoscaler != "keda":
            what = (
                "its HPA gets minReplicas: 1 (a plain HPA cannot scale from 0)"
                if autoscaler == "hpa"
                else "it runs at a fixed 1 replica (no autoscaler)"
            )
            out.append(
                f"pool {pool.name}: min: 0 does not sleep with --autoscaler {autoscaler}: "
                f"{what}, an always-on engine pod; render with --autoscaler keda to let it "
                "sleep"
            )
        if autoscaler == "none":
            continue
        if a.min == 0 and autoscaler == "keda" and engine == "vllm":
            # KEDA's poll and the scrape, then the engine's start (its own estimate).
            wake = 2 * scrape_s + pool.engine.health_timeout_s
            qt = spec.gateway.queue_timeout_s
            if qt < wake:
                out.append(
                    f"pool {pool.name}: min: 0 sleeps, and a request that wakes it waits in "
                    f"the gateway's queue for at most gateway.queue_timeout_s ({qt:g} s), "
                    f"less than a wake: KEDA's poll and the scrape (up to {2 * scrape_s} s) "
                    f"plus a vLLM start (engine.health_timeout_s: "
                    f"{pool.engine.health_timeout_s:g} s); its first requests would get 503 "
                    f"model_waking: set gateway.queue_timeout_s to at least {math.ceil(wake)}"
                    ", or give the pool min: 1"
                )
        s = pool.scaling
        cut = []
        if s.down_quiet_s > _WINDOW_MAX:
            cut.append(
                f"down_quiet_s {s.down_quiet_s:g} s -> stabilizationWindowSeconds {_WINDOW_MAX}"
            )
        for name in ("down_cooldown_s", "up_cooldown_s"):
            v = getattr(s, name)
            if v > _PERIOD_MAX:  # (below 1 s it is 1 s: no different to a user)
                cut.append(f"{name} {v:g} s -> periodSeconds {_PERIOD_MAX}")
        if cut:
            out.append(
                f"pool {pool.name}: the HPA's API bounds cut scaling settings on the cluster "
                f"({'; '.join(cut)}), while `unbroken up` keeps them as written"
            )
    return out
