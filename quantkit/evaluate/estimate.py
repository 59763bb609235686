"""Roofline sizing from a model's config alone: weight bytes, KV bytes per token, GPUs needed and the
single-stream decode speed that memory bandwidth allows.

Decoding one token reads every weight once plus the KV cache of the context, so tokens/s can be no higher
than bandwidth / bytes read. Nothing is loaded but config.json.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: float  # datasheet capacity, decimal GB
    bandwidth: float  # datasheet memory bandwidth, bytes/s


# Vendor datasheet figures (decimal units). Capacity is the marketed number; a margin is applied in estimate().
GPUS = {g.name: g for g in [
    GPU("h100", 80e9, 3.35e12),  # H100 SXM5 80GB, HBM3
    GPU("h100-pcie", 80e9, 2.0e12),
    GPU("h200", 141e9, 4.8e12),  # HBM3e
    GPU("a100", 80e9, 2.039e12),  # A100 SXM4 80GB
    GPU("a100-40gb", 40e9, 1.555e12),
    GPU("l40s", 48e9, 0.864e12),
    GPU("l4", 24e9, 0.3e12),
    GPU("a10g", 24e9, 0.6e12),
    GPU("rtx4090", 24e9, 1.008e12),
    GPU("mi300x", 192e9, 5.3e12),
]}

# Dense (no sparsity) tensor-core peaks from the vendors' datasheets, in operations/s, by the type the products
# run in; a GPU without a type's units is missing that key (A100: no FP8) and such precisions run in bf16.
TENSOR_OPS = {
    "h100": {"bf16": 989e12, "fp8": 1979e12, "int8": 1979e12},
    "h100-pcie": {"bf16": 756e12, "fp8": 1513e12, "int8": 1513e12},
    "h200": {"bf16": 989e12, "fp8": 1979e12, "int8": 1979e12},
    "a100": {"bf16": 312e12, "int8": 624e12},
    "a100-40gb": {"bf16": 312e12, "int8": 624e12},
    "l40s": {"bf16": 362e12, "fp8": 733e12, "int8": 733e12},
    "l4": {"bf16": 121e12, "fp8": 242e12, "int8": 242e12},
    "mi300x": {"bf16": 1307e12, "fp8": 2615e12, "int8": 2615e12},
}
# The type a precision's products run in: weight-only schemes dequantise to bf16; fp8 (quantkit's fp8 schemes
# quantise activations too) and w8a8 multiply 8-bit by 8-bit.
COMPUTE = {"fp8": "fp8", "w8a8": "int8"}

# Bits per stored weight of a quantised Linear, and whether a per-group (True) or per-channel scale comes with it.
PRECISIONS = {"bf16": (16, None), "fp16": (16, None), "fp8": (8, "channel"), "int8": (8, "channel"),
              "w8a8": (8, "channel"), "int4": (4, "group"), "nvfp4": (4, "nvfp4"), "mxfp4": (4, "mxfp4")}
# FP4 formats fix their own groups and scale dtypes: (group size, bytes per group scale, bytes per Linear):
# nvfp4 one E4M3 byte per 16 weights and a float32 global scale per Linear, mxfp4 one E8M0 byte per 32
FP4_SCALES = {"nvfp4": (16, 1, 4), "mxfp4": (32, 1, 0)}
KV_DTYPES = {"bf16": 2, "fp16": 2, "fp8": 1}
SCALE_BYTES = 2  # scales are stored in the model dtype (bf16/fp16)
USABLE_FRACTION = 0.9  # room left per GPU for activations, the CUDA context and fragmentation


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    experts: int = 1
    active_experts: int = 1
    attention_bias: bool = False

    def linear_shapes(self) -> list[tuple[int, int]]:
        """(out, in) of every quantisable Linear in one decoder layer, all experts included."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = [(q, h), (kv, h), (kv, h), (h, q)]
        mlp = [(self.intermediate, h), (self.intermediate, h), (h, self.intermediate)] * self.experts
        return attn + mlp

    def other_params_per_layer(self) -> int:
        bias = (self.heads + 2 * self.kv_heads) * self.head_dim if self.attention_bias else 0
        router = self.hidden * self.experts if self.experts > 1 else 0
        return 2 * self.hidden + bias + router  # two RMSNorm weights


def _first(cfg: dict, *keys, default=None):
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return default


def shape_from_config(cfg: dict) -> Shape:
    if "text_config" in cfg and "hidden_size" not in cfg:  # multimodal wrappers keep the LM config inside
        cfg = cfg["text_config"]
    hidden = _first(cfg, "hidden_size", "n_embd", "d_model")
    layers = _first(cfg, "num_hidden_layers", "n_layer", "num_layers")
    heads = _first(cfg, "num_attention_heads", "n_head")
    vocab = _first(cfg, "vocab_size")
    missing = [n for n, v in [("hidden_size", hidden), ("num_hidden_layers", layers),
                              ("num_attention_heads", heads), ("vocab_size", vocab)] if v is None]
    if missing:
        raise UserError(f"the config lacks {', '.join(missing)}; estimate needs a decoder-only LM config "
                        "(llama/mistral/qwen style)")
    inter = _first(cfg, "intermediate_size", "n_inner", "ffn_dim", default=4 * hidden)
    experts = int(_first(cfg, "num_local_experts", "num_experts", default=1))
    if experts > 1:
        inter = _first(cfg, "moe_intermediate_size", default=inter)
    return Shape(hidden=int(hidden), layers=int(layers), heads=int(heads),
                 kv_heads=int(_first(cfg, "num_key_value_heads", default=heads)),
                 head_dim=int(_first(cfg, "head_dim", default=hidden // heads)), intermediate=int(inter),
                 vocab=int(vocab), tied=bool(cfg.get("tie_word_embeddings", False)), experts=experts,
                 active_experts=int(_first(cfg, "num_experts_per_tok", default=experts)),
                 attention_bias=bool(cfg.get("attention_bias", False)))


def load_config(model: str) -> dict:
    """config.json as a dict from a file, a folder or a cached hub id (never downloads weights)."""
    p = Path(model).expanduser()
    if p.is_file():
        path = p
    elif p.is_dir():
        path = p / "config.json"
        if not path.is_file():
            raise UserError(f"'{model}' has no config.json; pass a model folder or a config.json file")
    else:
        try:
            from huggingface_hub import hf_hub_download

            path = Path(hf_hub_download(model, "config.json", local_files_only=True))
        except Exception:
            raise UserError(f"'{model}' is neither a file, a folder nor a cached hub id; pass the path of its "
                            "config.json") from None
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON ({e}); pass the model's config.json") from None
    if not isinstance(cfg, dict):
        raise UserError(f"{path} is not a JSON object; pass the model's config.json")
    return cfg


def param_counts(s: Shape) -> dict:
    linear = s.layers * sum(o * i for o, i in s.linear_shapes())
    embed = s.vocab * s.hidden * (1 if s.tied else 2)
    other = s.layers * s.other_params_per_layer() + s.hidden + embed  # final norm, embeddings, lm_head
    return {"linear": linear, "other": other, "total": linear + other}


def weight_bytes(s: Shape, precision: str, group_size: int = 128) -> int:
    """Decoder Linears at `precision`; embeddings, lm_head and norms stay 16-bit (quantkit's defaults)."""
    bits, scale = PRECISIONS[precision]
    n = param_counts(s)
    total = n["linear"] * bits // 8 + n["other"] * 2
    if scale == "group":
        total += n["linear"] // group_size * SCALE_BYTES
    elif scale == "channel":
        total += s.layers * sum(o for o, _ in s.linear_shapes()) * SCALE_BYTES
    elif scale in FP4_SCALES:
        gs, per_group, per_linear = FP4_SCALES[scale]
        total += n["linear"] // gs * per_group + s.layers * len(s.linear_shapes()) * per_linear
    return total


def active_weight_bytes(s: Shape, precision: str, group_size: int = 128) -> int:
    """Bytes one decode step reads: a mixture-of-experts model reads only the experts it routes to."""
    full = weight_bytes(s, precision, group_size)
    if s.experts <= 1:
        return full
    dense = Shape(**{**s.__dict__, "experts": 1, "active_experts": 1})
    per_expert = (weight_bytes(dense, precision, group_size) - weight_bytes(
        Shape(**{**dense.__dict__, "intermediate": 0}), precision, group_size))
    return full - (s.experts - s.active_experts) * per_expert


def prefill_tokens_per_s(s: Shape, gpu: str, precision: str, gpus: int) -> tuple[float | None, str | None]:
    """Compute-bound prefill: 2 operations per active Linear weight per prompt token at the tensor-core peak of
    the type the precision multiplies in (attention's own products left out, so an upper bound); and that type."""
    ops = TENSOR_OPS.get(gpu)
    if ops is None:
        return None, None
    kind = COMPUTE.get(precision, "bf16")
    kind = kind if kind in ops else "bf16"
    active = s.layers * (sum(o * i for o, i in s.linear_shapes()[:4]) + sum(
        o * i for o, i in s.linear_shapes()[4:7]) * s.active_experts)
    return gpus * ops[kind] / (2 * active), kind


def kv_bytes_per_token(s: Shape, kv_bytes: int = 2) -> int:
    return 2 * s.layers * s.kv_heads * s.head_dim * kv_bytes  # keys and values


def estimate(cfg: dict, gpu: str, precisions: list[str], context: int = 4096, batch: int = 1,
             kv_dtype: str = "bf16", group_size: int = 128) -> dict:
    gpu = gpu.lower()
    if gpu not in GPUS:
        raise UserError(f"unknown GPU '{gpu}'; known: {', '.join(GPUS)}")
    bad = [p for p in precisions if p not in PRECISIONS]
    if bad or not precisions:
        raise UserError(f"unknown precision {', '.join(bad) or '(none)'}; use a comma list of {', '.join(PRECISIONS)}")
    if kv_dtype not in KV_DTYPES:
        raise UserError(f"unknown KV dtype '{kv_dtype}'; use one of {', '.join(KV_DTYPES)}")
    if context < 1 or batch < 1:
        raise UserError("--context and --batch must be at least 1")
    if group_size < 1:
        raise UserError("--group-size must be at least 1")
    s = shape_from_config(cfg)
    g = GPUS[gpu]
    kv_tok = kv_bytes_per_token(s, KV_DTYPES[kv_dtype])
    kv_total = kv_tok * context * batch
    rows = {}
    for p in precisions:
        wb = weight_bytes(s, p, group_size)
        need = wb + kv_total
        gpus = max(1, math.ceil(need / (g.memory_bytes * USABLE_FRACTION)))
        # Every step reads the active weights once and each sequence's whole KV cache; tensor parallelism
        # spreads those reads over the GPUs' combined bandwidth (the ideal case, so this is an upper bound).
        read = active_weight_bytes(s, p, group_size) + kv_total
        tps = gpus * g.bandwidth / read
        prefill, kind = prefill_tokens_per_s(s, gpu, p, gpus)
        rows[p] = {"weight_bytes": wb, "kv_bytes_per_token": kv_tok, "kv_bytes": kv_total,
                   "total_bytes": need, "gpus": gpus, "tokens_per_s": tps, "batch_tokens_per_s": tps * batch,
                   "prefill_tokens_per_s": prefill, "prefill_compute": kind}
    return {"gpu": gpu, "gpu_memory_bytes": g.memory_bytes, "gpu_bandwidth": g.bandwidth,
            "usable_fraction": USABLE_FRACTION, "context": context, "batch": batch, "kv_dtype": kv_dtype,
            "group_size": group_size, "params": param_counts(s)["total"], "precisions": rows}
