"""An early-exit draft: the target's own first N decoder layers, then its final norm and its output head.

No training and no second set of weights: the draft is a view of the target whose layer list is cut short, so
it shares every tensor (embedding, layers, norm, head) and costs N/L of a target step per drafted token. It is
handed to a ModelDrafter (model_draft.py), which gives it its own KV cache (N layers deep) and rolls it back after
each verify; the target verifies every drafted token with the exact acceptance rule, so the output is the
target's whatever the draft proposes.
"""
from __future__ import annotations

import copy

import torch

from ..errors import UserError

PREFIX = "early-exit:"


def parse_layers(spec: str, total: int) -> int:
    """N from 'early-exit:N', checked against the target's layer count."""
    text = spec[len(PREFIX):]
    if not text.isdigit() or not 1 <= int(text) < total:
        raise UserError(f"--draft {spec!r}: N must be a whole number of layers from 1 to {total - 1} "
                        f"(the target has {total}), e.g. --draft early-exit:{max(1, total // 4)}")
    return int(text)


def _layer_list(model) -> torch.nn.ModuleList:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not hasattr(inner, "norm"):
        raise UserError(f"--draft early-exit needs a decoder with model.layers and model.norm "
                        f"(Llama, Mistral, Qwen); {type(model).__name__} has none: use --draft self-w4")
    return layers


def early_exit_draft(model, n_layers: int):
    """A model object running `model`'s first n_layers layers, its final norm and its head (shared tensors)."""
    layers = _layer_list(model)
    if not 1 <= n_layers < len(layers):
        raise UserError(f"an early exit needs 1 to {len(layers) - 1} layers, got {n_layers}")
    cfg = copy.deepcopy(model.config)
    cfg.num_hidden_layers = n_layers
    if isinstance(getattr(cfg, "layer_types", None), list):
        cfg.layer_types = cfg.layer_types[:n_layers]
    inner = _shallow(model.model)
    inner.layers = torch.nn.ModuleList(list(layers[:n_layers]))
    inner.config = cfg
    draft = _shallow(model)
    draft.model = inner
    draft.config = cfg
    return draft


def _shallow(module: torch.nn.Module) -> torch.nn.Module:
    """A new module object holding the same children and tensors, whose child table can be changed alone.

    Per-object state the runtime keys on the model (the SlotPool, a compiled step) is not copied: the draft gets
    its own. A step plan the loader attached is kept: it indexes layers in order and the draft's first N layers
    are the target's."""
    out = copy.copy(module)
    out._modules = dict(module._modules)
    return out
