"""`--set FIELD=VALUE`: the one syntax `quantkit run` and `quantkit quantize` share for any recipe field, and
the field list their --help shows (read from the recipe schema, so it cannot miss a field)."""
from __future__ import annotations

import typing

from pydantic import BaseModel

from ..errors import UserError
from ..recipe import Recipe

SET_HELP = "Set any recipe field: --set quant.gptq.damp=0.05 (repeatable; values are YAML: 64, true, a list)."


def parse_set(items: list[str]) -> dict:
    """--set quant.group_size=64 -> {'quant.group_size': 64}; values are YAML (numbers, true/false, lists)."""
    import yaml

    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--set '{item}': expected FIELD=VALUE, e.g. --set quant.group_size=64")
        try:
            out[key.strip()] = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            out[key.strip()] = raw
    return out


def _section(annotation) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)), None)


def field_sections(model: type[BaseModel] = Recipe, prefix: str = "") -> dict[str, list[str]]:
    """{section ('' for the top level): its leaf field names}, sections in schema order."""
    out: dict[str, list[str]] = {prefix: []}
    for name, info in model.model_fields.items():
        sub = _section(info.annotation)
        if sub is None or typing.get_origin(info.annotation) is list:  # quant.targets: a list, set whole
            out[prefix].append(name)
        else:
            out.update(field_sections(sub, f"{prefix}.{name}" if prefix else name))
    return out


def fields_help(skip: tuple[str, ...] = ()) -> str:
    """The --set field list for a command's --help; SKIP: top-level sections the command does not read."""
    lines = ["--set FIELD=VALUE takes these recipe fields (meanings and defaults: docs/recipes.md, or "
             "`quantkit recipe show NAME --resolved`):"]
    for section, names in field_sections().items():
        if names and section.split(".")[0] not in skip:
            lines.append(f"{section or 'top level'}: {', '.join(names)}")
    lines.append("Example: --set quant.gptq.damp=0.05 --set quant.awq.clip=false --set quant.kv_cache=fp8")
    return "\n\n".join(lines)
