"""inspect's per-layer-type summary: the Linears that repeat in every block folded into one row each.

A 30-block model has 210 quantised Linears but seven kinds of them; the figures a user compares are the spread
of error within a kind, so each row keeps min, median and max instead of a mean that hides the worst layer.
"""
from __future__ import annotations

import statistics


def layer_type(name: str) -> str:
    """`model.layers.3.self_attn.q_proj` -> `self_attn.q_proj`; later indices (experts) become `*`.

    Everything up to the first block index is the same container path for every block, so it says nothing;
    a name without an index (lm_head) is its own type."""
    parts = name.split(".")
    first = next((i for i, p in enumerate(parts) if p.isdigit()), None)
    if first is None:
        return name
    return ".".join("*" if p.isdigit() else p for p in parts[first + 1:])


def _spread(values: list) -> dict | None:
    known = [v for v in values if v is not None]
    if not known:
        return None  # the method recorded no such error (RTN has no calibration output to compare)
    return {"min": min(known), "median": statistics.median(known), "max": max(known)}


def summarise_layers(rows: list[dict]) -> list[dict]:
    """One entry per (layer type, scheme, group size, bits), in the order the types first appear.

    A bit budget gives one type several widths; those stay separate rows so no figure mixes two schemes."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((layer_type(r["layer"]), r["scheme"], r["group_size"], r["bits"]), []).append(r)
    return [{
        "type": kind, "count": len(members), "scheme": scheme, "group_size": group, "bits": bits,
        "bits_per_weight": round(statistics.fmean(m["bits_per_weight"] for m in members), 3),
        "weight_rel_error": _spread([m["weight_rel_error"] for m in members]),
        "output_rel_error": _spread([m["output_rel_error"] for m in members]),
    } for (kind, scheme, group, bits), members in groups.items()]
