"""What a mixture-of-experts run did, for quantkit.json and the CLI summary: tokens per expert, fallbacks."""
from __future__ import annotations

from torch import nn

from ..models.moe import experts_modules
from ..plan import Plan


def moe_summary(model: nn.Module, plan: Plan, stats: dict[str, dict]) -> dict:
    """Per experts module, the calibration tokens routed to each expert (from its first projection's stats),
    and every expert Linear that was rounded instead of solved, with the reason."""
    # each expert's Linears record the same count: keep the first seen per expert, in one pass over the stats
    seen: dict[str, int] = {}
    for n, s in stats.items():
        if "routed_tokens" in s:
            seen.setdefault(n.rpartition(".")[0], s["routed_tokens"])
    routed = {name: [seen.get(f"{name}.{e}") for e in range(len(mod))]
              for name, mod in experts_modules(model).items()}
    known = [c for cs in routed.values() for c in cs if c is not None]
    return {
        "experts_modules": len(routed),
        "experts": sum(len(cs) for cs in routed.values()),
        "calibrate_all_experts": plan.moe.get("calibrate_all_experts", False),
        "min_tokens": plan.moe.get("min_tokens"),
        "routed_tokens": routed,
        "fewest_routed_tokens": min(known) if known else None,
        "rtn_fallback": {n: s["fallback"] for n, s in stats.items() if s.get("fallback") and ".experts." in n},
    }
