"""config.json's quantization_config, checked field by field before anything is built from it.

A hand-edited or damaged config (a group size written as "64", 5 bits, a list where a map belongs) would
otherwise reach the module constructors and fail there with a traceback, or, worse, build modules whose shapes
happen to fit the stored tensors and compute garbage (a group size of 48 where 64 was written gives the same
number of groups over 128 inputs). Each message names the field by its path in config.json.
"""
from __future__ import annotations

from pathlib import Path

from ..errors import UserError
from .pack import BITS

_FIX = "restore config.json from the checkpoint quantkit wrote, or re-run quantkit quantize"
_STRATEGIES = ("tensor", "channel", "group", "tensor_group", "block", "token")
_BITS = {"int": BITS, "float": (4, 8)}


def _refuse(path: Path, field: str, value, want: str) -> UserError:
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    return UserError(f"{path / 'config.json'}: quantization_config.{field} is {shown} ({type(value).__name__}); "
                     f"expected {want}; {_FIX}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_weights(path: Path, field: str, w) -> None:
    if not isinstance(w, dict):
        raise _refuse(path, field, w, "an object")
    kind = w.get("type")
    if kind not in _BITS:
        raise _refuse(path, f"{field}.type", kind, "'int' or 'float'")
    if not _is_int(w.get("num_bits")) or w["num_bits"] not in _BITS[kind]:
        raise _refuse(path, f"{field}.num_bits", w.get("num_bits"),
                      f"one of {', '.join(map(str, _BITS[kind]))} for {kind} weights")
    strategy = w.get("strategy")
    if strategy not in _STRATEGIES:
        raise _refuse(path, f"{field}.strategy", strategy, f"one of {', '.join(_STRATEGIES)}")
    gs = w.get("group_size")
    if strategy in ("group", "tensor_group"):
        if not _is_int(gs) or gs <= 0:
            raise _refuse(path, f"{field}.group_size", gs, f"a positive integer for strategy '{strategy}'")
    elif gs is not None and not _is_int(gs):
        raise _refuse(path, f"{field}.group_size", gs, "an integer or null")
    if not isinstance(w.get("symmetric", True), bool):
        raise _refuse(path, f"{field}.symmetric", w.get("symmetric"), "true or false")


def _check_group(path: Path, name: str, group) -> None:
    field = f"config_groups.{name}"
    if not isinstance(group, dict):
        raise _refuse(path, field, group, "an object with targets and weights")
    targets = group.get("targets")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise _refuse(path, f"{field}.targets", targets, "a non-empty list of module names or patterns")
    _check_weights(path, f"{field}.weights", group.get("weights"))
    act = group.get("input_activations")
    if act is not None and not isinstance(act, dict):
        raise _refuse(path, f"{field}.input_activations", act, "an object or null")


def check_quantization_config(path: Path, qc) -> None:
    """UserError naming the first malformed field of QC, the quantization_config of the checkpoint at PATH."""
    if not isinstance(qc, dict):
        raise UserError(f"{path / 'config.json'}: quantization_config is a {type(qc).__name__}, not an object; {_FIX}")
    if qc.get("quant_method") != "compressed-tensors":
        raise UserError(f"'{path}' uses quant_method '{qc.get('quant_method')}'; quantkit loads compressed-tensors "
                        "checkpoints")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _refuse(path, "config_groups", groups, "a non-empty object of config groups")
    for name, group in groups.items():
        _check_group(path, name, group)
    ignore = qc.get("ignore")
    if ignore is not None and not (isinstance(ignore, list) and all(isinstance(i, str) for i in ignore)):
        raise _refuse(path, "ignore", ignore, "a list of module names or patterns")
    kv = qc.get("kv_cache_scheme")
    if kv is not None and not isinstance(kv, dict):
        raise _refuse(path, "kv_cache_scheme", kv, "an object or null")


def check_group_fits(path: Path, module: str, weights: dict, in_features: int) -> None:
    """A group size must divide the Linear's inputs: the modules hold in_features // group_size groups, so a
    size that does not divide would silently pair weights with the wrong scales."""
    gs = weights.get("group_size")
    if weights.get("strategy") in ("group", "tensor_group") and in_features % gs:
        raise UserError(f"{path / 'config.json'}: group_size {gs} does not divide {module}'s {in_features} inputs; "
                        f"{_FIX}")
