"""Write a quantised model as a checkpoint folder, atomically: a temporary folder beside OUT, renamed at the end.

A run that dies half-way leaves only a hidden `.OUT.partial-*` folder, never a half-written OUT (the next run on
OUT removes it: output.py); a write that fails (a full disk, a file-size limit) removes its own and is one line.
"""
from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import fields, replace
from pathlib import Path

import torch

from ..qweight import QWeight
from ..schemes import Scheme
from .compressed_tensors import quantization_config, save_tensors, tensors_for
from .fp4_tensors import share_global_scales
from .manifest import KEY as MANIFEST_KEY
from .manifest import build_manifest
from .moe_names import is_router, to_checkpoint
from .output import OutputClaim
from .safetensors_stream import Spec
from .write_failure import write_failure


def checkpoint_tensors(model: torch.nn.Module, qweights: dict[str, QWeight], extra: dict[str, torch.Tensor],
                       dtype: torch.dtype | None = None) -> tuple[dict[str, Spec], Iterator[tuple[str, torch.Tensor]]]:
    """The checkpoint's tensors as (name -> dtype and shape, a generator producing each tensor in turn), so the
    writer holds one float tensor or one Linear's packed tensors at a time. dtype: the storage dtype of float
    tensors and scales (default: the model's, which may be a wider compute dtype, e.g. float32 on a CPU for a
    float16 model)."""
    dtype = dtype or next(model.parameters()).dtype
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    quantised = {f"{n}.weight" for n in qweights}
    floats = {k: v for k, v in model.state_dict().items() if k not in quantised
              and not (tied and k == "lm_head.weight" and "lm_head" not in qweights)}  # tied: restored at load
    qweights = share_global_scales(qweights)

    def stored(v: torch.Tensor) -> torch.dtype:
        return dtype if v.is_floating_point() and v.element_size() > 1 else v.dtype

    specs = {k: Spec(stored(v), tuple(v.shape)) for k, v in floats.items()}
    for n, qw in qweights.items():
        specs.update(_layer_specs(n, qw, dtype))
    specs.update({k: Spec.of(v) for k, v in extra.items()})

    def produce():
        for k, v in floats.items():
            yield k, v.detach().cpu().to(stored(v))
        for n, qw in qweights.items():
            yield from tensors_for(n, qw, dtype).items()
        for k, v in extra.items():
            yield k, v.detach().cpu()
    return specs, produce()


def _layer_specs(name: str, qw: QWeight, dtype: torch.dtype) -> dict[str, Spec]:
    """A Linear's checkpoint tensors' dtypes and shapes, from meta copies of its codes (no packing work), or from
    the real tensors where a layout's code needs values."""
    try:
        on_meta = {f.name: getattr(qw, f.name).to("meta") for f in fields(qw)
                   if isinstance(getattr(qw, f.name), torch.Tensor)}
        made = tensors_for(name, replace(qw, **on_meta), dtype)
    except (NotImplementedError, RuntimeError):
        made = tensors_for(name, qw, dtype)
    return {k: Spec.of(t) for k, t in made.items()}


def write_checkpoint(out: Path, model: torch.nn.Module, qweights: dict[str, QWeight], plan: dict[str, Scheme],
                     tokenizer, meta: dict, extra: dict | None = None, kv_cache_scheme: dict | None = None,
                     overwrite: bool = False, dtype: torch.dtype | None = None,
                     claim: OutputClaim | None = None) -> Path:
    """claim: the OutputClaim the run took on OUT before its work; without one, OUT is claimed here."""
    if claim is None:
        with OutputClaim(out, None, overwrite) as own:
            return write_checkpoint(out, model, qweights, plan, tokenizer, meta, extra, kv_cache_scheme,
                                    overwrite, dtype, own)
    mt = getattr(model.config, "model_type", None)
    # routers (not always nn.Linear) are listed as ignored so engines that match 'Linear' leave them in float
    linears = [to_checkpoint(mt, n) for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) or (is_router(n) and hasattr(m, "weight"))]
    tmp = None
    try:
        tmp = claim.temporary()
        specs, tensors = checkpoint_tensors(model, qweights, extra or {}, dtype)
        save_tensors(tmp, {to_checkpoint(mt, k): s for k, s in specs.items()},
                     ((to_checkpoint(mt, k), v) for k, v in tensors))
        plan = {to_checkpoint(mt, n): s for n, s in plan.items()}
        config = model.config.to_dict()
        if dtype is not None:
            config["dtype"] = str(dtype).replace("torch.", "")
            config.pop("torch_dtype", None)
        if "lm_head" in qweights and config.get("tie_word_embeddings"):
            config["tie_word_embeddings"] = False  # the head now has its own (quantised) weights
        config["quantization_config"] = quantization_config(plan, linears, kv_cache_scheme)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str))
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        # last, over every file now in the folder: the digests of exactly what is renamed into place
        meta = {**meta, MANIFEST_KEY: build_manifest(tmp)}
        (tmp / "quantkit.json").write_text(json.dumps(meta, indent=2, default=str))
        return claim.commit(tmp)
    except BaseException as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        failure = write_failure(e, claim.out.parent, claim.out)
        if failure is not None:
            raise failure from None
        raise
