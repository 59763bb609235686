"""quantkit.json's fields, typed, before a reader formats them (inspect prints errors with `:.4f`, divides by
bit widths and sizes): a hand-edited or damaged record is one line naming the field, never a traceback.
Fields a reader does not use are not checked; absent and null fields are allowed (older checkpoints lack some).
"""
from __future__ import annotations

from pathlib import Path

from ..errors import UserError

FIX = "restore quantkit.json from the folder quantkit wrote, or re-run quantkit quantize"
_NUM, _INT, _STR, _MAP = "a number", "an integer", "a string", "an object"
TOP = {"layers": _MAP, "bit_budget": _MAP, "recipe": _MAP, "source_bytes": _INT, "method_reason": _STR,
       "moe": _MAP, "source_model": _STR}
LAYER = {"scheme": _MAP, "weight_rel_error": _NUM, "output_rel_error": _NUM, "awq_alpha": _NUM,
         "awq_clip_mean": _NUM, "smooth_alpha": _NUM, "gptq_guard": _STR, "signround_iters": _INT}
SCHEME = {"num_bits": _INT, "group_size": _INT, "name": _STR}
BUDGET = {"target": _NUM, "average_bits": _NUM, "layers": _MAP}


def _fits(value, want: str) -> bool:
    if value is None:
        return True
    if want == _MAP:
        return isinstance(value, dict)
    if want == _STR:
        return isinstance(value, str)
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return number and (want == _NUM or isinstance(value, int))


def _check(path: Path, where: str, obj: dict, fields: dict[str, str]) -> None:
    for key, want in fields.items():
        value = obj.get(key)
        if not _fits(value, want):
            shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
            raise UserError(f"{path}: {where}{key} is {shown} ({type(value).__name__}); expected {want}; {FIX}")


def check_meta(path: Path, meta: dict) -> None:
    """UserError naming the first field of META (PATH's quantkit.json) whose type a reader cannot use."""
    _check(path, "", meta, TOP)
    for prefix, rec in (meta.get("layers") or {}).items():
        _check(path, "layers.", {prefix: rec}, {prefix: _MAP})
        _check(path, f"layers.{prefix}.", rec, LAYER)
        scheme = rec.get("scheme") or {}
        _check(path, f"layers.{prefix}.scheme.", scheme, SCHEME)
        if scheme.get("num_bits") is not None and not 1 <= scheme["num_bits"] <= 8:
            raise UserError(f"{path}: layers.{prefix}.scheme.num_bits is {scheme['num_bits']}; expected 1 to 8; {FIX}")
    budget = meta.get("bit_budget") or {}
    _check(path, "bit_budget.", budget, BUDGET)
    for prefix, rec in (budget.get("layers") or {}).items():
        _check(path, "bit_budget.layers.", {prefix: rec}, {prefix: _MAP})
    _check(path, "recipe.", meta.get("recipe") or {}, {"quant": _MAP})
    _check(path, "recipe.quant.", (meta.get("recipe") or {}).get("quant") or {}, {"method": _STR})
