"""Layer-by-layer capture: run the model one decoder layer at a time over the calibration samples, and hand
over what a layer, a block inside it or a Linear is fed.

Only the current layer is moved to the compute device; the rest stays where it was loaded (CPU, or disk when
accelerate offloaded it). Each layer sees the outputs of the previous layer *after* that layer was quantised
(true sequential), so errors are corrected downstream instead of compounding. Memory is one layer plus the
calibration activations (kept on disk when they would not fit: spill.py). A pass stops as soon as everything
asked for has been seen (_Stop), so feeding the first Linears of a layer costs a fraction of the layer.
"""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Sequence
from typing import Callable

import torch
from torch import nn

from .. import heap
from ..distributed import Pool
from ..errors import UserError
from . import holdout
from .spill import subset


class _Stop(Exception):
    """Raised from a hook to end a forward pass early once the wanted activations are recorded."""


@dataclass
class LayerInputs:
    hidden: Sequence[torch.Tensor]  # one [1, T, H] per sample: a list, or spill.DiskStates
    kwargs: list[dict]  # the keyword arguments the model passed to the layer, per sample

    def take(self, idx: list[int]) -> "LayerInputs":
        # states on disk stay there: the subset reads each when it is reached
        return LayerInputs(subset(self.hidden, idx), [self.kwargs[j] for j in idx])


def split_inputs(inputs: LayerInputs, fraction: float) -> tuple[LayerInputs, LayerInputs | None]:
    """(fitted, held-out) samples by holdout.split: held-out None when nothing is held out on any rank."""
    kept, held = holdout.split(len(inputs.hidden), fraction)
    return inputs.take(kept), None if held is None else inputs.take(held)


def first_layer_inputs(model: nn.Module, layers: nn.ModuleList, samples: list[torch.Tensor], device,
                       hidden=None) -> LayerInputs:
    """Run the model's embedding part per sample and stop at the first decoder layer; the hidden states are
    appended to HIDDEN (a new list by default). A sample whose keyword arguments equal the previous sample's
    (rotary cos/sin, positions: the same for samples of one length) shares that sample's, so they are held once,
    not once per sample (33 MB for SmolLM2's 128 x 512 tokens)."""
    hidden = [] if hidden is None else hidden
    kwargs: list[dict] = []

    def grab(_mod, args, kw):
        h = args[0] if args else kw.pop("hidden_states")
        kw = {k: v for k, v in kw.items() if k not in ("past_key_values", "past_key_value", "use_cache")}
        hidden.append(h.detach())
        kwargs.append(kwargs[-1] if kwargs and _same(kw, kwargs[-1]) else kw)
        raise _Stop

    handle = layers[0].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            for ids in samples:
                try:
                    model(input_ids=ids.reshape(1, -1).to(device), use_cache=False)
                except _Stop:
                    pass
    finally:
        handle.remove()
    return LayerInputs(hidden, kwargs)


def _same(a, b) -> bool:
    """Equal keyword values: tensors of one shape and dtype holding the same numbers, containers item by item."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    # anything else (a cache object, a mask class) only when it is the very same object
    return a is b or (type(a) is type(b) and isinstance(a, (int, float, str, bool)) and a == b)


def run_layer(layer: nn.Module, inputs: LayerInputs, outs=None) -> Sequence[torch.Tensor]:
    """The layer's output for every sample, appended to OUTS (a new list by default)."""
    outs = [] if outs is None else outs
    with torch.no_grad():
        for h, kw in zip(inputs.hidden, inputs.kwargs):
            o = layer(h, **kw)
            outs.append((o[0] if isinstance(o, (tuple, list)) else o).detach())
    heap.trim()
    return outs


def linear_groups(layer: nn.Module, names: dict[nn.Module, str], inputs: LayerInputs) -> list[list[nn.Module]]:
    """Linears grouped by shared input, in the order the layer calls them (q/k/v, o, gate/up, down for llama).

    Found by running the layer once: no per-architecture table is needed for GPTQ's dependency order.
    """
    calls: list[tuple[nn.Module, int]] = []
    seen_inputs: dict[int, torch.Tensor] = {}  # kept alive so ids stay unique during the pass

    def hook(mod, args):
        x = args[0]
        seen_inputs.setdefault(id(x), x)
        calls.append((mod, id(x)))

    handles = [m.register_forward_pre_hook(hook) for m in names]
    try:
        with torch.no_grad():
            layer(inputs.hidden[0], **inputs.kwargs[0])
    finally:
        for h in handles:
            h.remove()
    groups: dict[int, list[nn.Module]] = {}
    for mod, key in calls:
        g = groups.setdefault(key, [])
        if mod not in g:
            g.append(mod)
    ordered = list(groups.values())
    missing = [n for m, n in names.items() if not any(m in g for g in ordered)]
    if missing:  # not called on this input (e.g. unused expert): solve alone, last
        ordered += [[m] for m in names if not any(m in g for g in ordered)]
    return ordered


class BlockCalls:
    """The (args, kwargs) a module inside the layer (AWQ's measured block) is called with, on whole samples up
    to BUDGET tokens (None: every sample), at least one sample that reaches it. With several ranks: the samples
    one process would keep (calibration samples are equally long), by their place in the whole set.
    convert: applied to each call as it is recorded (e.g. a float32 copy), so only that copy is held."""

    def __init__(self, module: nn.Module, budget: int | None = None, convert: Callable = lambda obj: obj):
        self.module, self.budget, self.convert = module, budget, convert
        self.calls: list[tuple[tuple, dict]] = []
        self.kept_tokens = 0
        self.keeping = False

    def start(self, j: int, hidden: torch.Tensor) -> None:
        """Sample j (this process's) is about to run: decide whether its call is recorded."""
        tokens = hidden.numel() // hidden.shape[-1]
        if self.budget is None:
            self.keeping = True
        elif Pool.active():
            g = Pool.index(j)
            self.keeping = g == 0 or (g + 1) * tokens <= self.budget
        else:
            self.keeping = not self.calls or self.kept_tokens + tokens <= self.budget
        if self.keeping:
            self.kept_tokens += tokens

    def hook(self, _mod, args, kwargs) -> None:
        if self.keeping:
            self.calls.append((self.convert(args), self.convert(kwargs)))


def feed_group(layer: nn.Module, group: list[nn.Module], inputs: LayerInputs,
               sink: Callable[[nn.Module, torch.Tensor], None], on_sample: Callable[[], None] | None = None,
               block: BlockCalls | None = None) -> None:
    """Run the layer on every sample, handing each group member's input to sink; stop once all have run.
    block: also record that module's calls (its pre-hook runs first, even when it is a group member itself)."""
    pending: set[int] = set()

    def hook(mod, args):
        sink(mod, args[0].detach())
        pending.discard(id(mod))
        if not pending:
            raise _Stop

    handles = [] if block is None else [block.module.register_forward_pre_hook(block.hook, with_kwargs=True)]
    handles += [m.register_forward_pre_hook(hook) for m in group]
    try:
        with torch.no_grad():
            for j, (h, kw) in enumerate(zip(inputs.hidden, inputs.kwargs)):
                pending.update(id(m) for m in group)
                if block is not None:
                    block.start(j, h)
                try:
                    layer(h, **kw)
                except _Stop:
                    pass
                if on_sample:
                    on_sample()
    finally:
        for hd in handles:
            hd.remove()
    heap.trim()  # a pass's freed temporaries, before the solve or the next pass (heap.py)


def check_finite(tensors: list[torch.Tensor], where: str) -> None:
    for t in tensors:
        if not torch.isfinite(t).all():
            raise UserError(f"NaN or Inf in the activations of {where}; load the model in float32 (--dtype float32) "
                            "or check the source weights")
