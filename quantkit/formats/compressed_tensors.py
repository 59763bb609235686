"""The checkpoint layout: compressed-tensors conventions, so transformers and vLLM load what we write.

Per quantised Linear `p`: INT4/INT8 -> p.weight_packed (int32), p.weight_scale, p.weight_shape, optionally
p.weight_zero_point (packed along dim 0) and p.weight_g_idx; FP8 -> p.weight (float8_e4m3fn), p.weight_scale,
optionally p.input_scale; W8A8 INT8 (`int-quantized`) -> p.weight (int8), p.weight_scale [out, 1], optionally
p.input_scale; NVFP4/MXFP4 -> formats/fp4_tensors.py. config.json gains `quantization_config`; quantkit.json records how it was made.
"""
from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path

import torch

from ..qweight import QWeight
from ..schemes import Scheme
from ..targets import matches
from .fp4_tensors import fp4_format, fp4_input_args, fp4_tensors, fp4_weights_args
from .pack import pack_int32
from .safetensors_stream import Spec, StreamWriter

SHARD_BYTES = 4 * 1024**3


def tensors_for(prefix: str, qw: QWeight, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    s = qw.scheme
    if s.is_fp4:
        return fp4_tensors(prefix, qw)
    if s.is_fp8 or s.is_int_activations:  # `float-quantized` / `int-quantized`: the codes as they are
        codes = qw.q.to(torch.float8_e4m3fn if s.is_fp8 else torch.int8)
        out = {f"{prefix}.weight": codes.contiguous(),
               f"{prefix}.weight_scale": qw.scale.to(dtype).contiguous()}
        if qw.input_scale is not None:
            out[f"{prefix}.input_scale"] = qw.input_scale.to(dtype).reshape(-1).contiguous()
        return out
    out = {f"{prefix}.weight_packed": pack_int32(qw.q, s.num_bits),
           f"{prefix}.weight_scale": qw.scale.to(dtype).contiguous(),
           f"{prefix}.weight_shape": torch.tensor(list(qw.q.shape), dtype=torch.int32)}
    if qw.zero is not None:
        out[f"{prefix}.weight_zero_point"] = pack_int32(qw.zero, s.num_bits, dim=0)
    if qw.g_idx is not None:
        out[f"{prefix}.weight_g_idx"] = qw.g_idx.to(torch.int32).contiguous()
    return out


def _weights_args(s: Scheme) -> dict:
    if s.is_fp4:
        return fp4_weights_args(s)
    d = {"num_bits": s.num_bits, "type": s.type, "symmetric": s.symmetric, "strategy": s.strategy,
         "group_size": s.group_size if s.strategy == "group" else None, "block_structure": None,
         "dynamic": False, "actorder": s.actorder, "observer": "minmax", "observer_kwargs": {}}
    return d


def _input_args(s: Scheme) -> dict | None:
    if s.is_fp4:
        return fp4_input_args(s)
    if s.activations is None:
        return None
    dynamic = s.activations == "dynamic"
    return {"num_bits": 8, "type": s.type, "symmetric": True, "strategy": "token" if dynamic else "tensor",
            "group_size": None, "block_structure": None, "dynamic": dynamic, "actorder": None,
            "observer": None if dynamic else "minmax", "observer_kwargs": {}}


def _format(s: Scheme) -> str:
    if s.is_fp4:
        return fp4_format(s)
    if s.is_int_activations:
        return "int-quantized"
    return "float-quantized" if s.is_fp8 else "pack-quantized"


def _suffix(name: str) -> str:
    """The module name with its decoder-layer index removed: model.layers.3.mlp.up_proj -> mlp.up_proj."""
    m = re.match(r".*?\.\d+\.(.*)$", name)
    return m.group(1) if m else name


def quantization_config(plan: dict[str, Scheme], all_linears: list[str], kv_cache: dict | None = None) -> dict:
    """config.json's quantization_config: one config group per distinct scheme.

    Targets are the class name 'Linear' when one scheme covers every quantised Linear (the rest listed in
    ignore), else per-group regexes over module-name suffixes, or exact names when suffixes are shared.
    """
    by_scheme: dict[Scheme, list[str]] = OrderedDict()
    for n, s in plan.items():
        by_scheme.setdefault(s, []).append(n)
    ignore = [n for n in all_linears if n not in plan]
    groups = {}
    if len(by_scheme) == 1:
        targets = {next(iter(by_scheme)): ["Linear"]}
    else:
        suffixes = {s: {_suffix(n) for n in names} for s, names in by_scheme.items()}
        ignored_suffixes = {_suffix(n) for n in ignore}
        targets = {}
        for s, names in by_scheme.items():
            others = set().union(*(v for k, v in suffixes.items() if k != s)) | ignored_suffixes
            if suffixes[s] & others:
                targets[s] = [f"re:^{re.escape(n)}$" for n in names]
            else:
                alt = "|".join(re.escape(x) for x in sorted(suffixes[s]))
                targets[s] = [f"re:.*\\.({alt})$" if all("." in n for n in names) else f"re:^({alt})$"]
    formats = {_format(s) for s in by_scheme}
    for i, (s, tg) in enumerate(targets.items()):
        groups[f"group_{i}"] = {"targets": tg, "weights": _weights_args(s), "input_activations": _input_args(s),
                                "output_activations": None, "format": _format(s)}
    return {
        "quant_method": "compressed-tensors",
        "format": formats.pop() if len(formats) == 1 else "mixed-precision",
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": ignore,
        "kv_cache_scheme": kv_cache,
        "global_compression_ratio": None,
        "sparsity_config": {},
    }


def save_tensors(folder: Path, specs: dict[str, Spec], items: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Write the tensors announced in specs (name -> dtype and shape) as safetensors shards of at most
    SHARD_BYTES (one file when small, plus an index when sharded), each tensor as `items` produces it: the
    checkpoint is never held whole (safetensors_stream.py). Returns the file names."""
    with StreamWriter(folder, specs, SHARD_BYTES, {"format": "pt"}) as w:
        for name, tensor in items:
            w.write(name, tensor)
    return w.files


def load_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() \
        else ["model.safetensors"]
    out = {}
    for f in files:
        out.update(load_file(str(folder / f)))
    return out


def module_targets(quant_config: dict, named_linears: dict[str, object]) -> dict[str, dict]:
    """{module name: config group} for the Linears a quantization_config covers (ours or another tool's)."""
    ignore = quant_config.get("ignore") or []
    out = {}
    for name, mod in named_linears.items():
        if any(matches(p, name, mod) for p in ignore):
            continue
        for group in quant_config.get("config_groups", {}).values():
            if any(matches(t, name, mod) for t in group.get("targets", [])):
                out[name] = group
                break
    return out
