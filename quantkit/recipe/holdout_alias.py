"""The three hold-out shares that were one per guard (quant.awq.holdout, quant.gptq.holdout,
quant.signround.holdout) are one now, calibration.holdout; recipes and --set written with the old keys keep
working for one release, with a warning naming the new form.

An old key sets calibration.holdout (over what the recipe says there: --set is applied to the whole resolved
recipe, so a default calibration.holdout cannot be told from a written one). Two old keys with different values
cannot both hold, and are refused.
"""
from __future__ import annotations

import warnings

OLD = ("awq", "gptq", "signround")


def one_holdout(data):
    """DATA (a recipe as a dict, before validation) with any quant.<solver>.holdout moved to calibration.holdout."""
    quant = data.get("quant") if isinstance(data, dict) else None
    if not isinstance(quant, dict):
        return data
    found = {k: quant[k]["holdout"] for k in OLD if isinstance(quant.get(k), dict) and "holdout" in quant[k]}
    if not found:
        return data
    if len(set(found.values())) > 1:
        given = ", ".join(f"quant.{k}.holdout={v}" for k, v in found.items())
        raise ValueError(f"{given}: the guards share one hold-out now; set calibration.holdout once")
    value = next(iter(found.values()))
    for k in found:
        warnings.warn(f"quant.{k}.holdout is now calibration.holdout, one share for every guard; write "
                      f"--set calibration.holdout={value} (or calibration: holdout: {value} in a recipe)",
                      FutureWarning, stacklevel=2)
    quant = {k: ({f: v for f, v in s.items() if f != "holdout"} if k in found else s) for k, s in quant.items()}
    calibration = data.get("calibration")
    calibration = dict(calibration) if isinstance(calibration, dict) else {}
    return {**data, "quant": quant, "calibration": {**calibration, "holdout": value}}
