"""The adaptive controller: reads the agent's eBPF signals and the engines' vLLM metrics every
200 ms, classifies each endpoint (normal, contended, recovering) against its own learned
baseline, and acts through the gateway's admin API (caps, tier routing, shedding). See
docs/controller.md."""

from unbroken.controller.actions import Actuator, Decision, EndpointView, Tiers
from unbroken.controller.classify import CONDITIONS, Detector, Reading, Transition
from unbroken.controller.service import Controller, ControllerConfig, run_controller, serve

__all__ = [
    "CONDITIONS",
    "Actuator",
    "Controller",
    "ControllerConfig",
    "Decision",
    "Detector",
    "EndpointView",
    "Reading",
    "Tiers",
    "Transition",
    "run_controller",
    "serve",
]
