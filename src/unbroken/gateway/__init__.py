"""The streaming gateway (`unbroken gateway`): the data plane in front of engine replicas."""

from unbroken.gateway._pool import Endpoint, State
from unbroken.gateway._server import Gateway, GatewayConfig, StaticEndpoint, run_gateway

__all__ = ["Endpoint", "Gateway", "GatewayConfig", "State", "StaticEndpoint", "run_gateway"]
