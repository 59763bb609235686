"""The base of every typed options model: the solvers' own (GPTQOptions beside gptq.py, ...) and the recipe
schema's sections, which embed them. Unknown keys and coerced types are errors, so a misspelt knob never
silently does nothing and YAML `damp: true` is reported rather than read as 1."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True)
