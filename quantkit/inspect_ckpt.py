"""What is in a checkpoint: per-layer scheme, bits per weight (scales included), error, and total size.

Reads safetensors headers only (shapes and dtypes), so inspecting a 70B checkpoint costs no memory.
"""
from __future__ import annotations

import math
from pathlib import Path

from .errors import UserError
from .formats.json_files import read_json_object
from .formats.meta_check import FIX, check_meta
from .formats.output import MARKER
from .formats.quant_config_check import check_quantization_config
from .formats.safetensors_header import REDO, read_header
from .formats.safetensors_header import nbytes as tensor_bytes
from .inspect_summary import summarise_layers

# what each method recorded per Linear in quantkit.json (issue 23.5): AWQ's scale exponent, clip and guard,
# SmoothQuant's migration strength, GPTQ's order, damping and guard, learned rounding's steps and fallback
SOLVER_KEYS = ("awq_alpha", "awq_guard", "awq_clip_mean", "awq_clip_reverted", "awq_clip_decorrelate", "awq_note",
               "smooth_alpha", "actorder", "damp", "gptq_guard", "held_out_error", "fallback", "signround_iters",
               "signround_final_loss", "signround_heldout_loss", "signround_heldout_rtn_loss", "signround_fallback")
_SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape", "input_scale",
             "weight_global_scale")


def _headers(folder: Path) -> dict[str, dict]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UserError(f"'{folder}' holds no .safetensors files; pass a folder written by quantkit quantize")
    out = {}
    for f in files:
        head = read_header(f)  # refuses a truncated file, whose sizes below would otherwise look right
        head.pop("__metadata__", None)
        out.update(head)
    return out


def _read_meta(folder: Path) -> dict:
    path = folder / MARKER
    if not path.exists() and not path.is_symlink():
        return {}  # another tool's checkpoint: no record of how it was made
    meta = read_json_object(path, FIX)
    check_meta(path, meta)
    return meta


def inspect_checkpoint(folder) -> dict:
    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise UserError(f"'{folder}' is not a checkpoint folder (no config.json)")
    config = read_json_object(cfg_path, "copy it again from the folder quantkit wrote or re-run quantkit quantize")
    qc = config.get("quantization_config")
    if qc is not None:
        check_quantization_config(folder, qc)
    qc = qc or {}
    meta = _read_meta(folder)
    heads = _headers(folder)
    layers = {}
    for key, h in heads.items():
        prefix, _, suffix = key.rpartition(".")
        # packed codes, or codes stored as they are: FP8 (float-quantized), INT8 W8A8 (int-quantized)
        if suffix in ("weight_packed",) or (suffix == "weight" and h["dtype"] in ("F8_E4M3", "I8")):
            layers[prefix] = {}
    groups = list(qc.get("config_groups", {}).values())
    default_bits = groups[0]["weights"]["num_bits"] if len(groups) == 1 else 4
    budget = meta.get("bit_budget") or {}
    rows = [_layer_row(prefix, heads, meta.get("layers", {}).get(prefix, {}), default_bits, len(groups) == 1,
                       budget) for prefix in layers]
    quant_bytes = sum(r.pop("nbytes") for r in rows)
    total = sum(tensor_bytes(h) for h in heads.values())
    source = meta.get("source_bytes")
    quant_values = sum(r["shape"][0] * r["shape"][1] for r in rows)
    float_values = _float_values(heads, set(layers))
    return {
        "checkpoint": str(folder),
        "format": qc.get("format"),
        "quant_method": qc.get("quant_method"),
        "layers": rows,
        # what the terminal prints by default: one row per kind of Linear (q_proj x 30), error spread kept
        "layer_types": summarise_layers(rows),
        "quantized_bytes": quant_bytes,
        # over the quantised Linears, scales included: what --bits budgets
        "average_bits_per_weight": round(8 * quant_bytes / max(1, quant_values), 4),
        "bit_budget": {k: budget[k] for k in ("target", "average_bits")} if budget else None,
        "total_bytes": total,
        "source_bytes": source,
        "compression": round(source / total, 3) if source else None,
        "method": meta.get("recipe", {}).get("quant", {}).get("method"),
        "method_reason": meta.get("method_reason"),  # set when the method was left to `auto`
        "calibration": meta.get("calibration"),
        # parameters stored in 16/32-bit float (embeddings, norms, routers, ignored layers), of all parameters
        "float_share": round(float_values / max(1, float_values + quant_values), 4),
        "float_weights": meta.get("float_weights"),
        "moe": _moe(meta.get("moe")),
    }


def _layer_row(prefix: str, heads: dict, lm: dict, default_bits: int, one_group: bool, budget: dict) -> dict:
    """One quantised layer's row: its scheme, shape, bits per weight (scales included) and errors."""
    parts = {s: heads[f"{prefix}.{s}"] for s in _SUFFIXES if f"{prefix}.{s}" in heads}
    sch = lm.get("scheme", {})
    codes = parts.get("weight_packed") or heads[f"{prefix}.weight"]
    if len(codes["shape"]) != 2 or 0 in codes["shape"]:
        raise UserError(f"the checkpoint's {prefix} codes have shape {codes['shape']}, not a matrix; {REDO}")
    if "weight_packed" in parts:
        out_f = parts["weight_packed"]["shape"][0]
        # int32 words of densely packed codes (3-bit ones straddle words), or (FP4) uint8 bytes of two
        words = parts["weight_packed"]["shape"][1]
        fp4 = parts["weight_packed"]["dtype"] == "U8"
        in_f = 2 * words if fp4 else 32 * words // sch.get("num_bits", default_bits)
    else:
        parts["weight"] = heads[f"{prefix}.weight"]
        out_f, in_f = parts["weight"]["shape"]
    nbytes = sum(tensor_bytes(h) for s, h in parts.items() if s != "weight_shape")
    return {
        "layer": prefix,
        "scheme": sch.get("name", "?"),
        "group_size": sch.get("group_size"),
        "bits": sch.get("num_bits", default_bits if one_group else None),
        "sensitivity": budget.get("layers", {}).get(prefix, {}).get("sensitivity"),
        "symmetric": sch.get("symmetric"),
        "shape": [out_f, in_f],
        "bits_per_weight": round(8 * nbytes / (out_f * in_f), 3),
        "weight_rel_error": lm.get("weight_rel_error"),
        "output_rel_error": lm.get("output_rel_error"),
        # the grid's rule is the scheme's (full range: signed scales, -2^(b-1) used), recorded beside the solver's
        "solver": {**({"grid": "full range"} if sch.get("full_range") else {}),
                   **{k: lm[k] for k in SOLVER_KEYS if k in lm}},
        "nbytes": nbytes,
    }


def _float_values(heads: dict[str, dict], quantised: set[str]) -> int:
    """Values of float tensors that are model parameters, not a quantised layer's scales or KV scales."""
    n = 0
    for key, h in heads.items():
        prefix = key.rpartition(".")[0]
        if h["dtype"] in ("F16", "BF16", "F32") and prefix not in quantised and not key.endswith(("k_scale", "v_scale")):
            n += math.prod(h["shape"])
    return n


def _moe(m: dict | None) -> dict | None:
    if not m:
        return None
    return {"experts": m.get("experts"), "fewest_routed_tokens": m.get("fewest_routed_tokens"),
            "calibrate_all_experts": m.get("calibrate_all_experts"), "rtn_fallback": len(m.get("rtn_fallback", {}))}


def solver_summary(rec: dict) -> str:
    """One short line of what the method did to a layer, for inspect's table (the JSON has every figure)."""
    parts = []
    if rec.get("awq_alpha") is not None:
        parts.append(f"awq a={rec['awq_alpha']:.2f}")
    if rec.get("awq_guard"):
        parts.append("awq guard kept rtn scales")
    if rec.get("awq_note"):
        parts.append(f"awq: {rec['awq_note']}")
    if rec.get("awq_clip_mean") is not None:
        parts.append(f"clip {rec['awq_clip_mean']:.3f}" + (f" ({rec['awq_clip_reverted']} undone)"
                                                            if rec.get("awq_clip_reverted") else ""))
    if rec.get("smooth_alpha") is not None:
        parts.append(f"smooth a={rec['smooth_alpha']:.2f}")
    if "actorder" in rec and rec.get("damp") is not None:
        parts.append(f"gptq act-order {rec['actorder'] or 'off'}")
    if rec.get("gptq_guard"):
        parts.append(f"guard chose {rec['gptq_guard'].split(':')[0]}")
    if rec.get("signround_iters"):
        parts.append(f"signround {rec['signround_iters']} steps")
    if rec.get("signround_fallback") or rec.get("fallback"):
        parts.append(f"fallback {rec.get('signround_fallback') or rec.get('fallback')}")
    return ", ".join(parts) or "-"
