"""Fault injection requests accepted by the engine's admin API."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["Config", "Fault", "FaultRequest"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SlowCuda(_Strict):
    """Bus contention: every launch, graph launch and copy takes `extra_ms` longer."""

    kind: Literal["slow_cuda"]
    extra_ms: Annotated[float, Field(gt=0, le=10_000)]
    duration_s: Annotated[float, Field(gt=0, le=86_400)] | None = None


class Hang(_Strict):
    """The engine stops producing tokens (a stuck device) while still answering /health."""

    kind: Literal["hang"]
    duration_s: Annotated[float, Field(gt=0, le=86_400)]


class Fail(_Strict):
    """A fraction of new requests fail: with a 500 before streaming, or with an error event
    after `after_tokens` tokens."""

    kind: Literal["fail"]
    fraction: Annotated[float, Field(ge=0, le=1)] = 1.0
    after_tokens: Annotated[int, Field(ge=1)] | None = None
    duration_s: Annotated[float, Field(gt=0, le=86_400)] | None = None


class Crash(_Strict):
    """The process dies at once (SIGKILL to itself), as on a segfault or an OOM kill."""

    kind: Literal["crash"]


Fault = Annotated[SlowCuda | Hang | Fail | Crash, Field(discriminator="kind")]


class FaultRequest(BaseModel):
    fault: Fault


class Config(_Strict):
    """Runtime settings an admin may change (vLLM has no such endpoint; the controller uses
    it where the engine offers it)."""

    max_num_seqs: Annotated[int, Field(ge=1, le=65_536)] | None = None
