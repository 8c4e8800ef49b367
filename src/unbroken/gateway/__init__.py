"""The streaming gateway (`unbroken gateway`): the data plane in front of engine replicas."""

from unbroken.gateway._policy import PickRequest, RoutingPolicy
from unbroken.gateway._pool import Endpoint, LeastLoad, State
from unbroken.gateway._process import default_workers
from unbroken.gateway._run import run_gateway
from unbroken.gateway._server import Gateway, GatewayConfig, StaticEndpoint

__all__ = [
    "Endpoint",
    "Gateway",
    "GatewayConfig",
    "LeastLoad",
    "PickRequest",
    "RoutingPolicy",
    "State",
    "StaticEndpoint",
    "default_workers",
    "run_gateway",
]
