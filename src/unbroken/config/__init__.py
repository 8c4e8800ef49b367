"""Configuration: the pipeline spec (YAML, pydantic-validated) and component settings."""

from unbroken.config.spec import (
    EngineSpec,
    GatewaySettings,
    PipelineSpec,
    PoolSpec,
    SpecError,
    default_spec,
    load_spec,
)

__all__ = [
    "EngineSpec",
    "GatewaySettings",
    "PipelineSpec",
    "PoolSpec",
    "SpecError",
    "default_spec",
    "load_spec",
]
