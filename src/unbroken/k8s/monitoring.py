"""Prometheus Operator rules and the Grafana dashboard for a pipeline on a cluster. Series
names are the ones the gateway, agent and controller export (see their docs pages)."""

from __future__ import annotations

import math
from typing import Any

import orjson

__all__ = ["dashboard", "prometheus_rule"]

CUDA_LAUNCH = "cudaLaunchKernel|cuLaunchKernel|cuLaunchKernelEx|cudaGraphLaunch|cuGraphLaunch"


def prometheus_rule(drain_deadline_s: float) -> dict[str, Any]:
    """PrometheusRule spec: recording rules (seed-compatible names included) and the alerts:
    contention, dropped streams, drains stuck past their deadline."""
    stuck_after = math.ceil(drain_deadline_s) + 60  # deadline, then migration has a minute
    return {
        "groups": [
            {
                "name": "unbroken-recording",
                "interval": "15s",
                "rules": [
                    {
                        "record": "unbroken:ttft_seconds:p99",
                        "expr": "histogram_quantile(0.99, sum by (le, pool) "
                        "(rate(unbroken_gateway_ttft_seconds_bucket[1m])))",
                    },
                    {
                        "record": "unbroken:itl_seconds:p99",
                        "expr": "histogram_quantile(0.99, sum by (le, pool) "
                        "(rate(unbroken_gateway_inter_token_seconds_bucket[1m])))",
                    },
                    {
                        "record": "unbroken:streams_dropped:rate5m",
                        "expr": "sum(rate(unbroken_gateway_streams_dropped_total[5m]))",
                    },
                ],
            },
            # The seed article's series, as in deploy/prometheus/recording-rules.yaml (a test
            # keeps the two equal).
            {
                "name": "unbroken-agent-seed-compat",
                "interval": "15s",
                "rules": [
                    {
                        "record": "ebpf_cuda_launch_latency_us",
                        "expr": "1e6 * histogram_quantile(0.99, sum by (le, endpoint, pod, "
                        "namespace) (rate(unbroken_cuda_call_duration_seconds_bucket"
                        f'{{function=~"{CUDA_LAUNCH}"}}[1m])))',
                    },
                    {
                        "record": "ebpf_socket_backpressure_ratio",
                        "expr": "sum by (endpoint, pod, namespace) "
                        "(rate(unbroken_socket_backpressure_seconds_total[1m]))",
                    },
                    {
                        "record": "ebpf_socket_send_buffer_fill_ratio",
                        "expr": "max by (endpoint, pod, namespace) "
                        "(unbroken_socket_send_buffer_fill_ratio)",
                    },
                ],
            },
            {
                "name": "unbroken-alerts",
                "rules": [
                    {
                        "alert": "UnbrokenHardwareContention",
                        "expr": "max by (endpoint) "
                        '(unbroken_controller_condition{condition="contended"}) == 1',
                        "for": "1m",
                        "labels": {"severity": "warning"},
                        "annotations": {
                            "summary": "{{ $labels.endpoint }}: contended (its CUDA call "
                            "latency, or without the node agent its inter-token latency, well "
                            "above its baseline with low backpressure); the controller has "
                            "lowered its cap and moved standard traffic to fp8.",
                        },
                    },
                    {
                        "alert": "UnbrokenStreamsDropped",
                        "expr": "sum(increase(unbroken_gateway_streams_dropped_total[5m])) > 0",
                        "labels": {"severity": "critical"},
                        "annotations": {
                            "summary": "{{ $value }} token stream(s) dropped in 5 minutes: "
                            "the gateway could neither finish nor migrate them.",
                        },
                    },
                    {
                        "alert": "UnbrokenDrainStuck",
                        "expr": "max by (endpoint, pool) "
                        '(unbroken_gateway_endpoint_state{state="draining"}) == 1',
                        "for": f"{stuck_after}s",
                        "labels": {"severity": "warning"},
                        "annotations": {
                            "summary": "{{ $labels.endpoint }} has been draining for more than "
                            f"{stuck_after} s (deadline {drain_deadline_s:g} s): streams "
                            "that cannot be migrated, or no ready endpoint to take them.",
                        },
                    },
                    {
                        # A replica out of rotation (its /health fails, or it hangs) that
                        # did not come back: on a cluster the kubelet's liveness probe
                        # restarts it within ~30 s; longer, it is crash-looping or stuck.
                        "alert": "UnbrokenEndpointOutOfRotation",
                        "expr": "min by (endpoint, pool) "
                        "((unbroken_gateway_endpoint_healthy == 0) and on (endpoint, pool) "
                        '(unbroken_gateway_endpoint_state{state="ready"} == 1))',
                        "for": "5m",
                        "labels": {"severity": "warning"},
                        "annotations": {
                            "summary": "{{ $labels.endpoint }} (pool {{ $labels.pool }}) "
                            "has been out of rotation for 5 minutes: its health checks "
                            "fail or it hangs; its pool serves with one replica less.",
                        },
                    },
                    {
                        # Every replica of a pool out of rotation: its traffic fails over
                        # to the route's next pool, or is refused (503 no_endpoint).
                        "alert": "UnbrokenPoolDown",
                        "expr": "max by (pool) (unbroken_gateway_endpoint_healthy) == 0",
                        "for": "1m",
                        "labels": {"severity": "critical"},
                        "annotations": {
                            "summary": "no replica of pool {{ $labels.pool }} passes its "
                            "health checks: its requests go to the next pool of their route "
                            "or get 503 no_endpoint.",
                        },
                    },
                    {
                        "alert": "UnbrokenKubernetesApiUnreachable",
                        "expr": "min by (pod, service) (unbroken_gateway_k8s_api_up) == 0",
                        "for": "2m",
                        "labels": {"severity": "warning"},
                        "annotations": {
                            "summary": "gateway {{ $labels.pod }} cannot watch "
                            "{{ $labels.service }}: it serves its last known endpoints.",
                        },
                    },
                ],
            },
        ]
    }


def _panel(
    pid: int,
    title: str,
    targets: list[str],
    x: int,
    y: int,
    kind: str = "timeseries",
    unit: str = "s",
) -> dict[str, Any]:
    return {
        "id": pid,
        "type": kind,
        "title": title,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [
            {
                "refId": chr(65 + i),
                "expr": t,
                **({"format": "heatmap"} if kind == "heatmap" else {}),
            }
            for i, t in enumerate(targets)
        ],
    }


def dashboard() -> str:
    q = "histogram_quantile({q}, sum by (le) (rate({m}_bucket[1m])))"
    panels = [
        _panel(
            1,
            "TTFT p50 / p99 / p99.9",
            [q.format(q=p, m="unbroken_gateway_ttft_seconds") for p in (0.5, 0.99, 0.999)],
            0,
            0,
        ),
        _panel(
            2,
            "Inter-token latency p50 / p99 / p99.9",
            [q.format(q=p, m="unbroken_gateway_inter_token_seconds") for p in (0.5, 0.99, 0.999)],
            12,
            0,
        ),
        _panel(
            3,
            "Active streams per endpoint",
            ["sum by (endpoint) (unbroken_gateway_inflight)"],
            0,
            8,
            unit="short",
        ),
        _panel(
            4,
            "Endpoint conditions (controller)",
            ["max by (endpoint, condition) (unbroken_controller_condition) == 1"],
            12,
            8,
            kind="state-timeline",
            unit="short",
        ),
        _panel(
            5,
            "CUDA call latency (launches)",
            [
                "sum by (le) (rate(unbroken_cuda_call_duration_seconds_bucket"
                f'{{function=~"{CUDA_LAUNCH}"}}[1m]))'
            ],
            0,
            16,
            kind="heatmap",
        ),
        _panel(
            6,
            "Socket backpressure (share of time at the threshold)",
            ["sum by (pod) (rate(unbroken_socket_backpressure_seconds_total[1m]))"],
            12,
            16,
            unit="percentunit",
        ),
        _panel(
            7,
            "Streams dropped / migrated per second",
            [
                "sum(rate(unbroken_gateway_streams_dropped_total[1m]))",
                "sum(rate(unbroken_gateway_streams_migrated_total[1m]))",
            ],
            0,
            24,
            unit="short",
        ),
        _panel(
            8,
            "Queue depth by priority",
            ["sum by (priority) (unbroken_gateway_queue_depth)"],
            12,
            24,
            unit="short",
        ),
    ]
    board = {
        "title": "unbroken",
        "uid": "unbroken",
        "schemaVersion": 39,
        "refresh": "5s",
        "time": {"from": "now-30m", "to": "now"},
        "templating": {
            "list": [{"name": "datasource", "type": "datasource", "query": "prometheus"}]
        },
        "panels": panels,
    }
    return orjson.dumps(board, option=orjson.OPT_INDENT_2).decode()
