"""Mixture-of-experts layers as one nn.Linear per expert projection, so every solver, the writer and the runtime
treat an expert like any dense MLP.

transformers 5 stores a layer's experts fused: `gate_up_proj` [experts, 2*inter, hidden] and `down_proj`
[experts, hidden, inter], computed as down(act(gate) * up) with gate, up = chunk(2) of the first product. A
module that is not a plain Linear is invisible to a plan built over nn.Linear, which is how a "W4" checkpoint
could keep most of its weights in 16 bits. `unfuse_experts` replaces each such module by `UnfusedExperts`,
whose children are named as the original checkpoints name them (formats/moe_names.py), with the same forward:
each expert sees only the tokens routed to it, so GPTQ's Hessian for an expert comes from exactly those tokens.

`calibrate_all` (off at serving time) runs every expert on every token while keeping the routed output, the
remedy for experts that routing starves of calibration tokens; `routed` counts the tokens routed to each expert.
"""
from __future__ import annotations

import torch
from torch import nn

from ..formats.moe_names import ExpertNames, expert_names

# the fused layout UnfusedExperts reproduces: transformers' use_experts_implementation flags and their values
_SUPPORTED_FLAGS = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
                    "has_post_expert_norm": False}


class ExpertMLP(nn.Module):
    """One expert: down(act(gate(x)) * up(x)), its Linears named as the checkpoint names them."""

    def __init__(self, hidden: int, inter: int, act: nn.Module, names: ExpertNames, dtype=None, device=None):
        super().__init__()
        self.names = names
        for attr, (i, o) in ((names.gate, (hidden, inter)), (names.up, (hidden, inter)), (names.down, (inter, hidden))):
            setattr(self, attr, nn.Linear(i, o, bias=False, dtype=dtype, device=device))
        self.act_fn = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.names
        return getattr(self, n.down)(self.act_fn(getattr(self, n.gate)(x)) * getattr(self, n.up)(x))


class UnfusedExperts(nn.ModuleList):
    """A ModuleList of ExpertMLPs (checkpoint names `experts.{e}.<proj>`) with the fused module's forward."""

    def __init__(self, experts: list[ExpertMLP]):
        super().__init__(experts)
        self.num_experts = len(experts)
        self.calibrate_all = False
        self.routed = torch.zeros(len(experts), dtype=torch.long)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        out = torch.zeros_like(hidden_states)
        hit = torch.zeros(self.num_experts, dtype=torch.bool)
        with torch.no_grad():
            counts = torch.bincount(top_k_index.reshape(-1).cpu(), minlength=self.num_experts)[: self.num_experts]
            self.routed += counts
            hit |= counts > 0
        for e, expert in enumerate(self):
            if not (hit[e] or self.calibrate_all):
                continue
            token_idx, slot = torch.where(top_k_index == e)
            if self.calibrate_all:
                y = expert(hidden_states)[token_idx]  # every token reaches the expert; only routed ones count
            else:
                y = expert(hidden_states[token_idx])
            y = y * top_k_weights[token_idx, slot, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out


def is_fused_experts(mod: nn.Module) -> bool:
    """A transformers 5 fused experts module (3-D gate_up_proj/down_proj parameters)."""
    gu, down = getattr(mod, "gate_up_proj", None), getattr(mod, "down_proj", None)
    return isinstance(gu, torch.Tensor) and isinstance(down, torch.Tensor) and gu.dim() == 3 and down.dim() == 3


def unfusable(mod: nn.Module) -> bool:
    """A fused experts module whose layout UnfusedExperts reproduces exactly (no biases, no interleaving, ...)."""
    return is_fused_experts(mod) and isinstance(getattr(mod, "act_fn", None), nn.Module) and all(
        getattr(mod, k, v) == v for k, v in _SUPPORTED_FLAGS.items())


def _pieces(e: int, inter: int, names: ExpertNames):
    """(projection, fused parameter, index) of expert E: where its weight lies in the fused layout."""
    return ((names.gate, "gate_up_proj", (e, slice(0, inter))), (names.up, "gate_up_proj", (e, slice(inter, None))),
            (names.down, "down_proj", (e,)))


def split(mod: nn.Module, names: ExpertNames) -> UnfusedExperts:
    """The experts of a fused module as Linears holding the same values (on the meta device when it is)."""
    gu = mod.gate_up_proj
    num, two_inter, hidden = gu.shape
    inter = two_inter // 2
    experts = []
    for e in range(num):
        ex = ExpertMLP(hidden, inter, mod.act_fn, names, dtype=gu.dtype, device="meta")
        if not gu.is_meta:
            for attr, fused, index in _pieces(e, inter, names):
                w = getattr(mod, fused)[index]
                getattr(ex, attr).weight = nn.Parameter(w.detach().clone(), requires_grad=False)
        experts.append(ex)
    return UnfusedExperts(experts)


def fused_sources(model: nn.Module) -> dict[str, tuple[str, tuple]]:
    """{an expert Linear's weight key: (the fused parameter's key, the index of its rows)} for every split experts
    module: what a lazy load reads when the checkpoint stores the experts fused (models/lazy.py)."""
    out = {}
    for name, mod in experts_modules(model).items():
        names = mod[0].names
        inter = getattr(mod[0], names.gate).out_features
        for e in range(len(mod)):
            for attr, fused, index in _pieces(e, inter, names):
                out[f"{name}.{e}.{attr}.weight"] = (f"{name}.{fused}", index)
    return out


def unfuse_experts(model: nn.Module) -> list[str]:
    """Replace every supported fused experts module in place; returns their names (empty for a dense model)."""
    names = expert_names(getattr(getattr(model, "config", None), "model_type", None))
    done = []
    for name, mod in list(model.named_modules()):
        if unfusable(mod):
            model.set_submodule(name, split(mod, names))
            done.append(name)
    return done


def experts_modules(model: nn.Module) -> dict[str, UnfusedExperts]:
    return {n: m for n, m in model.named_modules() if isinstance(m, UnfusedExperts)}


def set_calibrate_all(model: nn.Module, on: bool) -> None:
    for m in experts_modules(model).values():
        m.calibrate_all = on


def routed_tokens(model: nn.Module) -> dict[str, list[int]]:
    """{experts module name: tokens routed to each expert so far}."""
    return {n: m.routed.tolist() for n, m in experts_modules(model).items()}
