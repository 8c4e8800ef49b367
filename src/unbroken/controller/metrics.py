"""The controller's Prometheus series (/metrics): each endpoint's condition, transitions and
detection latency, its signal ratio and learned baseline, slow clients, actions applied,
poll time, the agent's liveness, read errors and probes. Every label value an alert may
watch is created at start, so a rate() over it exists before the first event."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from unbroken.wire.metrics import register_standard_metrics

__all__ = ["DETECTION_BUCKETS", "ControllerMetrics"]

DETECTION_BUCKETS = (0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)


class ControllerMetrics:
    """The controller's own series, in one registry (the autoscaler adds its own to it)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        register_standard_metrics(r, "controller")
        self.condition = Gauge(
            "unbroken_controller_condition",
            "1 for the endpoint's current condition.",
            ["endpoint", "condition"],
            registry=r,
        )
        self.transitions = Counter(
            "unbroken_controller_transitions",
            "Condition changes.",
            ["endpoint", "from", "to"],
            registry=r,
        )
        self.detection = Histogram(
            "unbroken_controller_detection_latency_seconds",
            "From the first window past the enter threshold to the condition change "
            "(the onset-to-action latency is measured by benchmarks/controller.py).",
            buckets=DETECTION_BUCKETS,
            registry=r,
        )
        self.ratio = Gauge(
            "unbroken_controller_signal_ratio",
            "Last window's signal over the endpoint's learned baseline.",
            ["endpoint", "source"],
            registry=r,
        )
        self.baseline = Gauge(
            "unbroken_controller_baseline_seconds",
            "Learned baseline of the signal the endpoint is judged by.",
            ["endpoint", "source"],
            registry=r,
        )
        self.slow_clients = Gauge(
            "unbroken_controller_slow_clients",
            "Streams whose client reads slower than the engine writes (reported, not acted on).",
            ["endpoint"],
            registry=r,
        )
        self.actions = Counter(
            "unbroken_controller_actions",
            "Actions applied through admin APIs.",
            ["action"],
            registry=r,
        )
        for a in (
            "lower cap",
            "raise cap",
            "restore cap",
            "route to degraded",
            "restore routes",
            "move streams",
            "engine max_num_seqs",
            "convert",
            "convert back",
        ):
            self.actions.labels(a)
        self.poll = Histogram(
            "unbroken_controller_poll_seconds",
            "Time to read every signal once.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
            registry=r,
        )
        self.agent_live = Gauge(
            "unbroken_controller_agent_live",
            "1 while the agent's eBPF signals are being read.",
            registry=r,
        )
        self.errors = Counter(
            "unbroken_controller_read_errors",
            "Signal reads that failed, by source.",
            ["source"],
            registry=r,
        )
        for s in ("gateway", "agent", "engine", "apply"):
            self.errors.labels(s)
        self.probes = Counter(
            "unbroken_controller_probes",
            "Small completions sent straight to a routed-around endpoint to measure it.",
            ["result"],
            registry=r,
        )
        for s in ("ok", "error"):
            self.probes.labels(s)
