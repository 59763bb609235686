"""Pass/fail thresholds on an eval report, so CI can reject a checkpoint that drifted too far.

Each gate names one metric of a variant and a bound; the baseline itself is never gated.
"""
from __future__ import annotations

from ..errors import UserError
from ..recipe.gates import GATES  # noqa: F401  (the table is the recipe's; eval checks the same names)


def parse_gates(items: list[str] | None) -> dict[str, float]:
    gates: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep:
            raise UserError(f"gate '{item}' is not NAME=VALUE; e.g. --gate max_kl_p99=0.5")
        validate_names([name])
        try:
            gates[name] = float(value)
        except ValueError:
            raise UserError(f"gate {name}: '{value}' is not a number; e.g. --gate {name}=0.5") from None
    return gates


def validate_names(names) -> None:
    bad = [n for n in names if n not in GATES]
    if bad:
        raise UserError(f"unknown gate {', '.join(bad)}; valid gates: {', '.join(GATES)}")


def validate_inputs(gates: dict, has_data: bool, has_tasks: bool) -> None:
    validate_names(gates)
    if "max_ppl_increase" in gates and not has_data:
        raise UserError("gate max_ppl_increase needs perplexity text; pass --data")
    for g in ("min_agreement", "min_exact_match"):
        if g in gates and not has_tasks:
            raise UserError(f"gate {g} needs a task set; pass --tasks FILE.jsonl")


def metric(row: dict, base: dict, name: str) -> float | None:
    if name == "max_ppl_increase":
        if row.get("ppl") is None or not base.get("ppl"):
            return None
        return row["ppl"] / base["ppl"] - 1.0
    if name == "min_agreement":
        return (row.get("all") or {}).get("answer_agreement")
    if name == "min_token_agreement":
        return row.get("token_agreement")
    if name == "max_kl_mean":
        return (row.get("kl") or {}).get("mean")
    if name == "max_kl_p99":
        return (row.get("kl") or {}).get("p99")
    if name == "min_exact_match":
        return (row.get("all") or {}).get("exact_match")
    raise KeyError(name)


def check_gates(report: dict, gates: dict[str, float]) -> list[str]:
    """One line per violated (variant, gate); an empty list means every variant passed."""
    validate_names(gates)
    rows = report["variants"]
    base = next(r for r in rows if r["is_base"])
    failures = []
    for row in rows:
        if row["is_base"]:
            continue
        for name, bound in gates.items():
            value = metric(row, base, name)
            if value is None:
                failures.append(f"{row['label']}: {name} cannot be checked (metric not measured)")
            elif (name.startswith("max_") and value > bound) or (name.startswith("min_") and value < bound):
                failures.append(f"{row['label']}: {name} = {value:.4g} violates {bound:g}")
    return failures
