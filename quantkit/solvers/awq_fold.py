"""Exact folding of AWQ scales: divide the previous operation's output by s, multiply the Linears' input columns
by s. In exact arithmetic the float model is unchanged; in float32 the change is rounding only.

The arithmetic is done in float32 and cast back, so a float16 model takes one rounding per weight.
"""
from __future__ import annotations

import torch
from torch import nn

from .awq_maps import ScaleGroup


def prev_width(layer: nn.Module, group: ScaleGroup) -> int:
    """How many channels the previous operation hands to the group's Linears."""
    prev = layer.get_submodule(group.prev)
    if isinstance(prev, nn.Linear):
        a, b = group.prev_rows or (0, prev.out_features)
        return b - a
    w = getattr(prev, "weight", None)
    if w is None or w.dim() != 1:
        raise ValueError(f"{group.prev} ({type(prev).__name__}) has no per-channel gain to fold AWQ scales into")
    return w.numel()


@torch.no_grad()
def fold_scales(layer: nn.Module, group: ScaleGroup, s: torch.Tensor, norm_offset: float = 0.0) -> None:
    """Move the per-channel scales s [channels] (all > 0) from the previous operation into the group's Linears."""
    s = s.float()
    prev = layer.get_submodule(group.prev)
    if isinstance(prev, nn.Linear):
        a, b = group.prev_rows or (0, prev.out_features)
        w = prev.weight
        w.data[a:b] = (w.data[a:b].float() / s.to(w.device)[:, None]).to(w.dtype)
        if prev.bias is not None:
            prev.bias.data[a:b] = (prev.bias.data[a:b].float() / s.to(w.device)).to(prev.bias.dtype)
    else:
        w = prev.weight
        if w is None or w.dim() != 1 or w.numel() != s.numel():
            raise ValueError(f"{group.prev} has no gain of {s.numel()} channels to fold AWQ scales into")
        sd = s.to(w.device)
        # the norm computes x_hat * (offset + weight); the new gain must be (offset + weight) / s
        w.data = ((norm_offset + w.data.float()) / sd - norm_offset).to(w.dtype)
        bias = getattr(prev, "bias", None)
        if isinstance(bias, torch.Tensor):
            bias.data = (bias.data.float() / sd).to(bias.dtype)
    for name in group.linears:
        lin = layer.get_submodule(name)
        lin.weight.data = (lin.weight.data.float() * s.to(lin.weight.device)[None, :]).to(lin.weight.dtype)
