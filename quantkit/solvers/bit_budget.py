"""Mixed precision under a bit budget: which integer width each Linear gets so the average fits a target.

Sensitivity is a weight-only proxy: the relative squared error ||W - RTN_b(W)||^2 / ||W||^2 of round-to-nearest
at each candidate width, times the Linear's weight count. For inputs of unit, uncorrelated channels it is the
Linear's output noise-to-signal ratio, weighted by its size so a larger Linear counts for more; it needs no
calibration pass, so `--method rtn --bits 4.5` stays data-free and every method gets the same choice. What it
misses is the input scale and how much each Linear's output matters to the loss: bench/lowbit_frontier.py
measures it against uniform widths (docs/benchmarks.md), where it does not beat halving the group size.

Bits are counted as `quantkit inspect` counts them: the codes in whole int32 words, a scale per group in the
checkpoint's dtype (16 bits; 32 for a float32 model), packed zero points when asymmetric.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats.pack import packed_words
from ..schemes import Scheme
from .rtn import rtn_quantize


def stored_bits(scheme: Scheme, out_features: int, in_features: int, scale_bits: int = 16) -> int:
    """Bits a Linear of this shape takes in the checkpoint under SCHEME, its scales SCALE_BITS wide (the
    checkpoint's dtype); weight_shape's 8 bytes left out."""
    groups = 1 if scheme.group_size == -1 else in_features // scheme.group_size
    bits = 32 * packed_words(in_features, scheme.num_bits) * out_features + scale_bits * groups * out_features
    if not scheme.symmetric:
        bits += 32 * packed_words(out_features, scheme.num_bits) * groups
    return bits


def rounding_error(weight: torch.Tensor, scheme: Scheme, scale_dtype=torch.float16) -> float:
    """numel * ||W - RTN(W)||_F^2 / ||W||_F^2 on SCHEME's grid, in float64."""
    qw = rtn_quantize(weight, scheme, scale_dtype=scale_dtype)
    w = weight.double()
    return float((qw.dequantize().double() - w).pow(2).sum() / w.pow(2).sum().clamp_min(1e-30) * w.numel())


@dataclass
class Option:
    scheme: Scheme
    bits: int  # stored bits of the whole Linear
    error: float
    weights: int  # out_features * in_features


def choose_widths(options: dict[str, list[Option]], target: float) -> dict[str, Option]:
    """Per Linear, the option to write so that total stored bits / total weights <= TARGET.

    Every Linear starts at its cheapest option; then, greedily, the upgrade removing the most error per extra
    bit that still fits is taken, until none fits. Raises ValueError, carrying the cheapest average, when even
    the cheapest options exceed the target (the caller words it for the user)."""
    weights = sum(opts[0].weights for opts in options.values())
    budget = target * weights
    chosen = {n: min(opts, key=lambda o: o.bits) for n, opts in options.items()}
    spent = sum(o.bits for o in chosen.values())
    if spent > budget + 1e-9:
        raise ValueError(f"{spent / weights:.3f}")
    while True:
        best, best_rate = None, 0.0
        for name, opts in options.items():
            cur = chosen[name]
            for o in opts:
                extra, gain = o.bits - cur.bits, cur.error - o.error
                if extra > 0 and gain > 0 and spent + extra <= budget and gain / extra > best_rate:
                    best, best_rate = (name, o), gain / extra
        if best is None:
            return chosen
        spent += best[1].bits - chosen[best[0]].bits
        chosen[best[0]] = best[1]

