"""Checkpoint names for mixture-of-experts layers: the per-expert names the original Hugging Face checkpoints use.

transformers 5 fuses each layer's experts into 3-D parameters on load and splits them again on save; vLLM's
loaders read the split, per-expert names (`mlp.experts.{e}.gate_proj`, Mixtral's `block_sparse_moe.experts.{e}.w1`)
and stack them into their own fused layout. quantkit quantises each expert as its own Linear (models/moe.py) and
writes it under that original name, so every engine finds what it expects. Module names inside quantkit follow
the transformers 5 module tree; only the checkpoint keys are renamed here.
"""
from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertNames:
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    block: str = "mlp"  # the sparse block's attribute in the checkpoint (transformers 5 always calls it mlp)


_DEFAULT = ExpertNames()
# Mixtral's original checkpoints (and vLLM's MixtralForCausalLM) use w1/w3/w2 under block_sparse_moe
_BY_TYPE = {"mixtral": ExpertNames("w1", "w3", "w2", "block_sparse_moe")}

# Routers read the hidden state and pick experts; they stay in float (a quantised router changes which experts
# run, an error no later layer can correct). Names relative to the decoder layer, as checkpoints spell them.
ROUTER_SUFFIXES = ("mlp.gate", "block_sparse_moe.gate", "mlp.shared_expert_gate")


def expert_names(model_type: str | None) -> ExpertNames:
    return _BY_TYPE.get(model_type or "", _DEFAULT)


def to_checkpoint(model_type: str | None, name: str) -> str:
    """A module or tensor name of the loaded model -> its name in the checkpoint."""
    block = expert_names(model_type).block
    if block == "mlp":
        return name
    return re.sub(r"(\.layers\.\d+\.)mlp\.", rf"\g<1>{block}.", name)


def from_checkpoint(model_type: str | None, key: str) -> str:
    """A checkpoint key -> the name in the transformers 5 module tree (the inverse of to_checkpoint)."""
    block = expert_names(model_type).block
    if block == "mlp":
        return key
    return re.sub(rf"(\.layers\.\d+\.){re.escape(block)}\.", r"\g<1>mlp.", key)


def is_router(name: str) -> bool:
    return any(name.endswith("." + s) or name == s for s in ROUTER_SUFFIXES)
