"""What every section of the spec shares: strict models (an unknown key is an error that
names the field) and the priority classes."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

Priority = Literal["critical", "standard", "sheddable"]


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid")
