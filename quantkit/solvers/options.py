"""The base of every typed options model: the solvers' own (GPTQOptions beside gptq.py, ...) and the recipe
schema's sections, which embed them. Unknown keys and coerced types are errors, so a misspelt knob never
silently does nothing and YAML `damp: true` is reported rather than read as 1."""
from __future__ import annotations

import warnings

from pydantic import BaseModel, ConfigDict


class StrictOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True)


def renamed(data, old: str, new: str, section: str):
    """A section's raw input (before validation) with OLD's value moved to NEW ('key' or 'subsection.key'), and
    a warning naming both: a renamed knob keeps working for one release. SECTION: the section's recipe path."""
    if not isinstance(data, dict) or old not in data:
        return data
    warnings.warn(f"{section}.{old} is now {section}.{new} (same meaning); rename it", FutureWarning, stacklevel=3)
    out = {k: v for k, v in data.items() if k != old}
    node = out
    *parents, leaf = new.split(".")
    for key in parents:
        sub = node.get(key)
        node[key] = sub.model_dump() if isinstance(sub, BaseModel) else dict(sub or {})
        node = node[key]
    node[leaf] = data[old]
    return out
