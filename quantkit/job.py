"""The quantise job: claim OUT, load the float model, plan, calibrate, run the pipeline, write the checkpoint.

The plan is built once here and handed to the pipeline and the writer; OUT is claimed (checked, writable,
locked) before anything is loaded and held until the checkpoint is renamed into place.
"""
from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch

from . import distributed, preflight
from .devices import proc_kib
from .errors import UserError
from .plan import Plan, build_plan
from .recipe import Recipe
from .schemes import get_scheme


def quantize_to_checkpoint(recipe: Recipe, progress=None, lazy: bool = True) -> dict:
    """The whole job; returns a summary for the CLI.

    lazy: read one decoder layer at a time from the safetensors files (see models/lazy.py); the whole model is
    loaded instead when the checkpoint's key names need converting, it is not safetensors, or calibration
    text is sampled from the model itself.
    """
    from .formats.output import OutputClaim
    from .models.hf import resolve_model_dir

    if not recipe.output:
        raise UserError("no output folder; pass -o OUT")
    for name in [recipe.quant.scheme, *(t.scheme for t in recipe.quant.targets)]:
        get_scheme(name)
    src = resolve_model_dir(recipe.model)  # once: a hub id means a snapshot lookup; below, the folder is used
    distributed.init_from_env(recipe.device)
    with distributed.peer_failures():
        if distributed.rank() != 0:  # under torchrun rank 0 alone claims OUT and writes; the others compute
            if not distributed.agree(True):
                raise UserError("rank 0 could not claim the output folder (its message says why); nothing was written")
            summary = _run(recipe, src, None, None, lazy)
            # every rank leaves the process group together, after rank 0's write: a rank that left while rank 0
            # still wrote was seen to abort in gloo's teardown (SIGABRT, "terminate called without an active
            # exception"), failing a run whose checkpoint was fine
            distributed.barrier()
            return summary
        try:
            claim = OutputClaim(Path(recipe.output), src, recipe.overwrite)
        except BaseException:
            distributed.agree(False)
            raise
        distributed.agree(True)
        with claim:
            summary = _run(recipe, src, claim, progress, lazy)
        distributed.barrier()
        return summary


def _load(recipe: Recipe, folder: Path, storage: torch.dtype, lazy: bool):
    """(model, tokenizer, source, LazyWeights or None, plan): layer-by-layer loading unless only a full load works."""
    from .models.hf import load_float_model
    from .models.lazy import open_lazy
    from .pipeline.sampling_copy import float_fits
    from .models.moe import unfuse_experts

    # A CPU has no fast float16/bfloat16 matmul (calibration passes ran 13x slower in float16 than in float32 on
    # SmolLM2), so the model computes in float32 there; the checkpoint is still written in the storage dtype.
    compute = "float32" if recipe.device == "cpu" else recipe.dtype
    opened = open_lazy(str(folder), compute) if lazy else None
    plan, early = None, []
    if opened is not None:
        model, tok, src, weights = opened
        # no weight is read yet: a --seq-len past the context or too little calibration text stops the run here
        plan = build_plan(model, recipe, storage, _weight_reader(model, weights),
                          before_reading=lambda r: early.append(preflight.check(r, model.config, src, tok)))
        self_calib = (recipe.calibration.spec or "self") == "self"
        # self-calibration samples from the whole float model when it fits, else from an RTN copy (_calibration)
        if not (self_calib and plan.needs_data) or not float_fits(model, recipe.max_memory,
                                                                  recipe.calibration.seq_len):
            return model, tok, src, weights, plan, (early or [None])[0]
        del model, weights, opened
    model, tok, src = load_float_model(str(folder), compute, recipe.device)
    unfuse_experts(model)
    # the lazy model's plan holds for the whole one (the same Linears: both split fused experts with
    # unfuse_experts), so a bit budget's weights are not read twice. A model only a whole load reads (not
    # safetensors, or keys to convert) is checked here, after that load.
    plan = plan or build_plan(model, recipe, storage,
                              before_reading=lambda r: early.append(preflight.check(r, model.config, src, tok)))
    return model, tok, src, None, plan, (early or [None])[0]


def _weight_reader(model, weights):
    """name -> a Linear's float weight, read from disk (and dropped again) when the model is loaded lazily."""
    def read(name: str) -> torch.Tensor:
        mod = model.get_submodule(name)
        lazy = weights is not None and mod.weight.is_meta
        if lazy:
            weights.materialise([f"{name}.weight"])
        w = mod.weight.detach().float().clone()
        if lazy:
            weights.release([name])
        return w
    return read


def _calibration(recipe: Recipe, model, tok, weights=None, start_anon: int | None = None):
    """Text the model samples itself (preflight.check read any other); from an RTN copy when _load kept MODEL
    lazy because the float model does not fit."""
    from .pipeline.sampling_copy import float_rows, held_beside, sample_with_rtn_copy, sampling_record

    def load(sampler, rows: int, openings=None):
        return preflight.calibration(recipe, tok, model=sampler, batch_size=rows, opening_model=openings)

    seq_len, bits = recipe.calibration.seq_len, None
    if weights is not None:
        # the cap is for all the run holds: on the host, the tokenizer and the like come out of it too
        held = held_beside(model, start_anon) if recipe.device == "cpu" else 0
        cs, bits = sample_with_rtn_copy(model, weights, recipe.device, recipe.max_memory, seq_len, load, held)
    else:
        cs = load(model, float_rows(model, recipe.max_memory, seq_len))
    cs.meta["sampled_by"] = sampling_record(model, recipe.max_memory, bits)
    return cs.samples, cs.meta


def _run(recipe: Recipe, folder: Path, claim, progress, lazy: bool) -> dict:
    from .formats.writer import write_checkpoint
    from .models.hf import read_config, resolve_dtype
    from .models.lazy import meta_tensors
    from .capture.spill import Spill
    from .pipeline import quantize_model
    from .pipeline.sampling_copy import cap_bytes

    t0, start_anon = time.time(), proc_kib("/proc/self/status", "RssAnon")
    config = read_config(folder)
    storage = resolve_dtype(recipe.dtype, config)
    model, tok, src, weights, plan, early = _load(recipe, folder, storage, lazy)
    recipe = plan.recipe  # 'auto' settled by the plan: calibration and quantkit.json's recipe say what ran
    source_bytes = sum(p.numel() for p in model.parameters()) * torch.empty((), dtype=storage).element_size()
    calib, calib_meta = early or (_calibration(recipe, model, tok, weights, start_anon) if plan.needs_data
                                  else (None, None))
    if calib is not None:  # data-parallel: this process calibrates on its share of the samples
        calib = distributed.shard(calib)
    with _scratch(claim) as scratch, _code_spool(scratch, claim, recipe, weights is not None) as spool:
        result = quantize_model(model, plan, calib, progress=progress, device=recipe.device, weights=weights,
                                keep=spool.keep if spool is not None else None,
                                spill=Spill(scratch / "activations", cap_bytes(recipe.max_memory, recipe.device)))
        dropped = {f"{n}.weight" for n in result.qweights}
        stray = [k for k in meta_tensors(model) if k not in dropped]
        if stray:  # a bug, not bad input: the writer would save empty tensors
            raise RuntimeError(f"tensors never read from the source model: {', '.join(stray[:5])}")
        meta = _metadata(recipe, plan, result, src, source_bytes, calib_meta, model)
        meta["processes"] = distributed.world()
        if claim is None:  # not rank 0: the same layers were solved here, rank 0 writes them
            return {"output": None, "rank": distributed.rank()}
        path = write_checkpoint(claim.out, model, result.qweights, plan.schemes, tok, meta, result.tensors,
                                plan.kv_scheme, recipe.overwrite, dtype=storage, claim=claim)
    errs = [s.get("weight_rel_error") for s in result.stats.values() if s.get("weight_rel_error") is not None]
    return {"output": str(path), "source": str(src), "layers": len(plan.schemes), "method": plan.method,
            "method_reason": plan.method_reason,
            "scheme": recipe.quant.scheme, "group_size": plan.group_size,
            "mean_weight_rel_error": sum(errs) / len(errs) if errs else None,
            "seconds": round(time.time() - t0, 2), "calibration": calib_meta,
            "loading": "layer by layer" if weights is not None else "whole model", "activations": result.activations,
            "float_weights": len(plan.uncovered), "moe": _moe_line(meta.get("moe"))}


@contextlib.contextmanager
def _scratch(claim):
    """The run's own temporary folder, removed when it ends: the claim's (beside OUT, which a killed run's
    successor clears), or the system's temp folder on a rank that does not write."""
    import shutil
    import tempfile

    path = claim.temporary() if claim is not None else Path(tempfile.mkdtemp(prefix=".quantkit-scratch-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _code_spool(scratch: Path, claim, recipe: Recipe, streamed: bool):
    """Where a streamed run keeps its solved codes until the write (formats/code_spool.py), in the run's scratch
    folder. A whole-model run holds the float model anyway, and keeps its codes in memory."""
    from .formats.code_spool import CodeSpool

    if not streamed:
        return contextlib.nullcontext()
    (scratch / "codes").mkdir()
    return CodeSpool(scratch / "codes", claim.out if claim is not None else Path(recipe.output))


def _moe_line(moe: dict | None) -> dict | None:
    """The CLI summary's view of quantkit.json's moe record (per-expert counts stay in the file)."""
    if not moe:
        return None
    return {"experts": moe["experts"], "fewest_routed_tokens": moe["fewest_routed_tokens"],
            "rtn_fallback": len(moe["rtn_fallback"]), "calibrate_all_experts": moe["calibrate_all_experts"]}


def _metadata(recipe: Recipe, plan: Plan, result, src, source_bytes: int, calib_meta, model) -> dict:
    """quantkit.json: what was run, on what, with which versions, and what each layer came out as."""
    import platform

    import transformers

    from .formats.manifest import source_identity
    from .version import __version__

    from .models.moe import experts_modules
    from .pipeline.moe_report import moe_summary

    resolved = recipe.model_copy(deep=True)
    resolved.quant.group_size = plan.group_size
    return {
        "quantkit_version": __version__,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
        "source_model": str(src),
        **source_identity(Path(src)),
        "source_bytes": source_bytes,
        "recipe": resolved.model_dump(mode="json"),
        **({"method_reason": plan.method_reason} if plan.method_reason else {}),
        "calibration": calib_meta or {"spec": None, "reason": "method needs no calibration data"},
        "seeds": {"calibration": recipe.calibration.seed},
        "layers": {n: {**result.stats.get(n, {}), "scheme": s.to_dict()} for n, s in plan.schemes.items()},
        "quantize_seconds": round(result.seconds, 2),
        "dtypes": {"compute": str(next(model.parameters()).dtype), "storage": str(plan.storage_dtype)},
        "float_weights": [{"name": u.name, "values": u.numel, "module": u.module_type} for u in plan.uncovered],
        **({"moe": moe_summary(model, plan, result.stats)} if experts_modules(model) else {}),
        **({"bit_budget": plan.bit_budget} if plan.bit_budget else {}),
    }
