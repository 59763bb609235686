"""The measured block of an AWQ scale group: its captured inputs, a float32 copy, and its output error.

Shared by AWQ's alpha search, its held-out guard (awq_guard.py) and SmoothQuant's migration search.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from ..capture.layer import BlockCalls, feed_group
from ..distributed import Pool
from ..schemes import Scheme
from .awq_maps import ScaleGroup
from .rtn import rtn_quantize


def _float32(obj):
    if isinstance(obj, torch.Tensor):
        return obj.float() if obj.is_floating_point() else obj
    if isinstance(obj, tuple):
        return tuple(_float32(o) for o in obj)
    if isinstance(obj, list):
        return [_float32(o) for o in obj]
    if isinstance(obj, dict):
        return {k: _float32(v) for k, v in obj.items()}
    return obj


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _relative(name: str, block: str) -> str:
    if name == block:
        return ""
    if not name.startswith(block + "."):
        raise ValueError(f"AWQ map error: {name} is not inside the measured block {block}")
    return name[len(block) + 1:]


class _GroupData:
    """What one ScaleGroup's search needs, captured in one partial pass over the layer per sample."""

    def __init__(self):
        self.abs_sum = None
        self.abs_max = None  # max|x| per channel (SmoothQuant's statistic)
        self.tokens = 0
        self.calls: list[tuple[tuple, dict]] = []  # the block's (args, kwargs) for the kept samples

    @property
    def x_mean(self) -> torch.Tensor:
        return (self.abs_sum / max(self.tokens, 1)).float()


def _capture_group(layer: nn.Module, block: nn.Module, first_linear: nn.Module, inputs,
                   budget: int | None) -> _GroupData:
    """One partial pass per sample (capture.feed_group): the block's calls on whole samples up to BUDGET tokens
    (None: all), kept in float32, and mean|x|, max|x| of the first Linear's input over every sample."""
    data = _GroupData()

    def on_linear(_mod, x):
        x = x.reshape(-1, x.shape[-1]).float()
        # summed in float64: the samples' order (one process, or ranks pooled) then leaves x_mean unchanged
        s, m = x.abs().sum(0, dtype=torch.float64), x.abs().amax(0)
        data.abs_sum = s if data.abs_sum is None else data.abs_sum + s
        data.abs_max = m if data.abs_max is None else torch.maximum(data.abs_max, m)
        data.tokens += x.shape[0]

    calls = BlockCalls(block, budget, convert=_float32)
    feed_group(layer, [first_linear], inputs, on_linear, block=calls)
    data.calls = calls.calls
    return _pooled(data, first_linear)


def _pooled(data: _GroupData, first: nn.Module) -> _GroupData:
    """Every rank's channel statistics (a rank whose samples never reached the group contributes zeros)."""
    if not Pool.active():
        return data
    width = first.weight.shape[-1]  # a router is not an nn.Linear: no in_features
    device = data.abs_sum.device if data.abs_sum is not None else "cpu"
    data.abs_sum = Pool.sum(data.abs_sum if data.abs_sum is not None
                            else torch.zeros(width, device=device, dtype=torch.float64))
    data.abs_max = Pool.max(data.abs_max if data.abs_max is not None else torch.zeros(width, device=device))
    data.tokens = Pool.count(data.tokens)
    return data


@torch.no_grad()
def measured_copy(block, group: ScaleGroup, linears: dict, data: _GroupData, per_token: bool = True):
    """A float32 copy of the measured block, its copies of the group's Linears, their original weights, the
    block's float outputs on the kept samples and each output's weight in the error (block_error).

    per_token: every token weighs the same, its squared error taken relative to its own output power. A few
    tokens with outsized activations (attention sinks, chat markers) carry up to a quarter of a layer's output
    power in SmolLM2; weighted by power they decide the scale for all text, and the choice carries less well to
    text without them (docs/benchmarks.md, "Every token counts the same"). Else: the error relative to the
    samples' total output power."""
    work = copy.deepcopy(block).float()
    copies = {n: work.get_submodule(_relative(n, group.block)) for n in linears}
    originals = {n: m.weight.detach().float().clone() for n, m in copies.items()}
    refs = [_first(work(*a, **kw)) for a, kw in data.calls]
    powers = [r.double().pow(2).sum(-1, keepdim=True) for r in refs]
    # with several ranks each holds some of the kept samples: the weights are normalised over all of them
    total = Pool.total(float(sum(p.sum() for p in powers)))
    if per_token:
        tokens = Pool.count(sum(p.numel() for p in powers)) or 1
        # a token whose output is (near) zero would otherwise weigh without bound
        floor = max(total / tokens, 1e-30) * 1e-6
        weights = [1.0 / (p.clamp_min(floor) * tokens) for p in powers]
    else:
        weights = [1.0 / (total or 1.0)] * len(refs)
    return work, copies, originals, refs, weights


@torch.no_grad()
def block_error(work, data: _GroupData, refs: list, weights: list) -> float:
    total = 0.0
    for (a, kw), r, w in zip(data.calls, refs, weights):
        total += float(((_first(work(*a, **kw)).double() - r.double()).pow(2) * w).sum())
    return Pool.total(total)  # every rank then picks the same candidate


def fake_quantize(w: torch.Tensor, scheme: Scheme, scale_dtype) -> torch.Tensor:
    return rtn_quantize(w, scheme, scale_dtype=scale_dtype).dequantize()


def quantised_error(block, group: ScaleGroup, linears: dict, quantised: dict, data: _GroupData, scale_dtype):
    """error(s): the block's per-token relative output error on DATA's samples when the group's quantised
    Linears are scaled by s, fake-quantised on their scheme's grid, and unscaled (the float reference: the block
    as it is)."""
    work, copies, originals, refs, weights = measured_copy(block, group, linears, data)

    def error(s: torch.Tensor) -> float:
        for n, sch in quantised.items():
            copies[n].weight.data = fake_quantize(originals[n] * s, sch, scale_dtype) / s
        return block_error(work, data, refs, weights)
    return error, originals
