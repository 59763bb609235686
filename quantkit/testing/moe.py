"""Tiny random mixture-of-experts models (a few layers, 4-8 experts, top-2), built in-process in seconds."""
from __future__ import annotations

from pathlib import Path

import torch

_COMMON = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
# model_type -> config kwargs; expert widths are multiples of 64 so group sizes 32 and 64 divide them
MOE_ARCHS = {
    "qwen3_moe": dict(moe_intermediate_size=64, intermediate_size=256, num_experts=8, num_experts_per_tok=2,
                      head_dim=32, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True),
    "mixtral": dict(intermediate_size=128, num_local_experts=4, num_experts_per_tok=2),
    "olmoe": dict(intermediate_size=64, num_experts=8, num_experts_per_tok=2),
    "qwen2_moe": dict(moe_intermediate_size=64, intermediate_size=256, num_experts=4, num_experts_per_tok=2,
                      shared_expert_intermediate_size=128, decoder_sparse_step=1, mlp_only_layers=[]),
}


def tiny_moe(arch: str = "qwen3_moe", seed: int = 0, vocab_size: int = 512, layers: int = 2,
             std: float = 0.05, dtype=torch.float32):
    """Every matrix (the 3-D expert tensors too) drawn from N(0, std): the default init is so small that
    quantisation error would hide in it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(arch, **_COMMON, **MOE_ARCHS[arch], vocab_size=vocab_size, num_hidden_layers=layers,
                               bos_token_id=None, eos_token_id=None, pad_token_id=None,
                               experts_implementation="eager")  # the loop over experts runs in float64 too
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, std)
    return model.eval()


def save_tiny_moe(folder: Path, arch: str = "qwen3_moe", **kw) -> Path:
    tiny_moe(arch, **kw).save_pretrained(folder)
    return Path(folder)
