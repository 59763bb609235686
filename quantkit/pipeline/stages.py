"""Stages of one decoder layer's solve: groups of Linears fed in one pass over the calibration samples.

A dense layer's stages are its input-sharing groups in call order (q/k/v, o, gate/up, down). A mixture-of-
experts layer has one gate/up group and one down group per expert; feeding each alone would run the layer
2 x experts times per sample, so groups that play the same role in different experts (the names match once the
expert index is wildcarded) are fed together. Each expert still gets its own solver and only its own tokens, and
every gate/up is solved before any down reads its output, as true sequential needs.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from .. import distributed
from ..models.moe import UnfusedExperts

_EXPERT_INDEX = re.compile(r"\.experts\.\d+\.")


def role(name: str) -> str:
    return _EXPERT_INDEX.sub(".experts.*.", name)


def stages(groups: list[list[nn.Module]], names: dict[nn.Module, str]) -> list[list[nn.Module]]:
    """GROUPS (capture.linear_groups) merged by role, in the order each role first appears."""
    merged: dict[tuple[str, ...], list[nn.Module]] = {}
    for g in groups:
        merged.setdefault(tuple(role(names[m]) for m in g), []).extend(g)
    return list(merged.values())


def expert_linears(layer: nn.Module) -> dict[nn.Module, tuple[UnfusedExperts, int]]:
    """{Linear inside an expert: (its experts module, expert index)} for one decoder layer."""
    out = {}
    for mod in layer.modules():
        if isinstance(mod, UnfusedExperts):
            for e, expert in enumerate(mod):
                for lin in expert.modules():
                    if isinstance(lin, nn.Linear):
                        out[lin] = (mod, e)
    return out


class ExpertFeed:
    """Around one stage's feeding: counts the tokens routed to each expert (reset first, so the counts are one
    pass over the samples) and, with calibrate_all, runs every expert on every token while it feeds. With
    several ranks each counted its share of the samples; the counts are summed, so every rank (and quantkit.json)
    has what one process feeding every sample counts."""

    def __init__(self, stage: list[nn.Module], experts: dict, calibrate_all: bool):
        # in stage order, which every rank shares: the counts are pooled in one tensor, in this order
        self.owners = list(dict.fromkeys(experts[m][0] for m in stage if m in experts))
        self.device = stage[0].weight.device if stage else None
        self.calibrate_all = calibrate_all

    def __enter__(self):
        for o in self.owners:
            o.routed.zero_()
            o.calibrate_all = self.calibrate_all
        return self

    def __exit__(self, exc_type, *exc):
        for o in self.owners:
            o.calibrate_all = False
        if exc_type is None and self.owners and distributed.active():
            # on the layer's device: NCCL reduces CUDA tensors only
            counts = distributed.Pool.sum(torch.cat([o.routed for o in self.owners]).to(self.device))
            for o, c in zip(self.owners, counts.cpu().split([len(o.routed) for o in self.owners])):
                o.routed.copy_(c)
        return False
