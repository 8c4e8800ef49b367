"""Kubernetes: manifests rendered from a pipeline spec (`unbroken render k8s`), the rules
they must keep (policy), the engine pods' readiness and preStop hooks, and EndpointSlice
discovery for the gateway. `discovery` is the only module that imports lightkube."""

from unbroken.k8s.manifests import RenderOptions, grace_period
from unbroken.k8s.render import PolicyError, previous_token, render, write

__all__ = ["PolicyError", "RenderOptions", "grace_period", "previous_token", "render", "write"]
