"""Where AWQ may move scale between operations, per architecture.

Each ScaleGroup names, inside one decoder layer, an operation whose output feeds some Linears and nothing else
(so dividing that output per channel by s and multiplying the Linears' input columns by s leaves the float model
unchanged), the Linears, and the module whose output error judges a candidate s. A norm's output can take the
division in its weight (and bias); a previous Linear takes it in its output rows (and bias), or only in a slice
of rows when it is a fused projection whose other rows go elsewhere.

Architectures are looked up by `config.model_type`; a builder may return None when a config variant breaks the
assumptions (OPT with post-norm), which counts as unmapped.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class ScaleGroup:
    prev: str  # module (relative to the layer) whose output is the Linears' input
    linears: tuple[str, ...]  # Linears that read exactly that output
    block: str  # module whose output error is measured when choosing s
    prev_rows: tuple[int, int] | None = None  # fused previous Linear: only rows [a, b) feed the Linears


@dataclass(frozen=True)
class ArchMap:
    groups: tuple[ScaleGroup, ...]
    # Gemma's RMSNorm multiplies by (1 + weight): the effective gain is offset + weight
    norm_offset: float = 0.0
    # Linears whose outputs become attention logits: their own output error says little about the softmax they
    # feed, so a clip chosen on it tends to hurt; they keep their full range (the usual AWQ practice).
    no_clip: tuple[str, ...] = field(default_factory=tuple)


def _llama_like(ffn_norm: str = "post_attention_layernorm", norm_offset: float = 0.0):
    def build(config) -> ArchMap:
        return ArchMap(
            groups=(
                ScaleGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                           "self_attn"),
                # skipped at run time when v_proj's rows are not o_proj's columns (grouped-query attention)
                ScaleGroup("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"),
                ScaleGroup(ffn_norm, ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
                # down(act(gate) * up): scaling up's rows scales down's input, whatever the activation
                ScaleGroup("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
            ),
            norm_offset=norm_offset,
            no_clip=("self_attn.q_proj", "self_attn.k_proj"),
        )
    return build


def _phi3(config) -> ArchMap:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q = config.num_attention_heads * head_dim
    kv = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) * head_dim
    inter = config.intermediate_size
    return ArchMap(
        groups=(
            ScaleGroup("input_layernorm", ("self_attn.qkv_proj",), "self_attn"),
            # value rows sit after query and key rows in the fused projection
            ScaleGroup("self_attn.qkv_proj", ("self_attn.o_proj",), "self_attn.o_proj", prev_rows=(q + kv, q + 2 * kv)),
            ScaleGroup("post_attention_layernorm", ("mlp.gate_up_proj",), "mlp"),
            # gate, up = chunk(2): up is the second half, and it multiplies act(gate) elementwise
            ScaleGroup("mlp.gate_up_proj", ("mlp.down_proj",), "mlp.down_proj", prev_rows=(inter, 2 * inter)),
        ),
        no_clip=("self_attn.qkv_proj",),
    )


def _opt(config) -> ArchMap | None:
    if not getattr(config, "do_layer_norm_before", True) or not getattr(config, "layer_norm_elementwise_affine", True):
        return None  # post-norm (opt-350m) or gain-less norms: nothing precedes the projections to fold into
    groups = [
        ScaleGroup("self_attn_layer_norm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn"),
        ScaleGroup("self_attn.v_proj", ("self_attn.out_proj",), "self_attn.out_proj"),
        # OPT has no MLP module: fc1's own output is the measured block
        ScaleGroup("final_layer_norm", ("fc1",), "fc1"),
    ]
    if getattr(config, "activation_function", "relu") == "relu":  # relu(x / s) = relu(x) / s only for relu
        groups.append(ScaleGroup("fc1", ("fc2",), "fc2"))
    return ArchMap(groups=tuple(groups), no_clip=("self_attn.q_proj", "self_attn.k_proj"))


def _moe(router: str = "mlp.gate", shared: bool = False):
    """Sparse MoE layers (experts split into Linears by models/moe.py). The post-attention norm feeds the router
    and every expert's gate/up (and a shared expert and its gate): one scale shared by all of them, folded into
    the routers' float weights too so routing is unchanged. Each expert's up feeds only its own down, so that
    scale is per expert. The router comes first: it reads every token, so mean|x| is taken over all of them."""
    def build(config) -> ArchMap:
        from ..formats.moe_names import expert_names

        n = expert_names(getattr(config, "model_type", None))
        count = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
        experts = [f"mlp.experts.{e}" for e in range(count)]
        ffn = [router] + [f"{x}.{p}" for x in experts for p in (n.gate, n.up)]
        per_expert = [ScaleGroup(f"{x}.{n.up}", (f"{x}.{n.down}",), f"{x}.{n.down}") for x in experts]
        if shared:
            ffn += ["mlp.shared_expert_gate", "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"]
            per_expert.append(ScaleGroup("mlp.shared_expert.up_proj", ("mlp.shared_expert.down_proj",),
                                         "mlp.shared_expert.down_proj"))
        attn = _llama_like()(config).groups[:2]
        return ArchMap(groups=(*attn, ScaleGroup("post_attention_layernorm", tuple(ffn), "mlp"), *per_expert),
                       no_clip=("self_attn.q_proj", "self_attn.k_proj"))
    return build


BUILDERS: dict[str, Callable] = {
    "qwen3_moe": _moe(),
    "olmoe": _moe(),
    "mixtral": _moe(),
    "qwen2_moe": _moe(shared=True),
    "llama": _llama_like(),
    "mistral": _llama_like(),
    "qwen2": _llama_like(),
    "qwen3": _llama_like(),  # q_norm/k_norm act per head after q/k_proj, which see unchanged inputs
    "gemma": _llama_like(norm_offset=1.0),
    "gemma2": _llama_like("pre_feedforward_layernorm", norm_offset=1.0),
    "gemma3_text": _llama_like("pre_feedforward_layernorm", norm_offset=1.0),
    "phi3": _phi3,
    "opt": _opt,
}


def mapped_architectures() -> list[str]:
    return sorted(BUILDERS)


def map_for(config) -> ArchMap | None:
    build = BUILDERS.get(getattr(config, "model_type", None))
    return build(config) if build else None
