"""`quantkit quantize` and `quantkit demo`."""
from __future__ import annotations

from typing import Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .common import app, console, emit_json


def _progress(quiet: bool):
    if quiet:
        return None
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=False)


def _run(recipe, quiet: bool, as_json: bool) -> None:
    from ..job import quantize_to_checkpoint

    prog = _progress(quiet or as_json)
    if prog is None:
        summary = quantize_to_checkpoint(recipe)
    else:
        with prog:
            summary = quantize_to_checkpoint(recipe, progress=prog)
    if as_json:
        emit_json(summary)
    elif not quiet:
        err = summary["mean_weight_rel_error"]
        console.print(f"[green]wrote[/] {summary['output']}: {summary['layers']} layers, {summary['scheme']} "
                      f"{summary['method']} g{summary['group_size']}, mean weight error "
                      f"{err:.4f}, {summary['seconds']} s" if err is not None else f"[green]wrote[/] {summary['output']}")
        if summary.get("method_reason"):
            console.print(f"method {summary['method_reason']}")
        if summary.get("moe"):
            m = summary["moe"]
            console.print(f"experts: {m['experts']} quantised; fewest calibration tokens routed to one: "
                          f"{m['fewest_routed_tokens']}; rounded (RTN) for lack of tokens: {m['rtn_fallback']} Linears")


# quantize's options -> the recipe fields they set; tests/test_cli_recipe_parity.py checks that every recipe
# knob is here (or in its short list of fields a flag cannot express) and that each name is a real option
FLAG_FIELDS = {
    "model": "model", "output": "output", "overwrite": "overwrite", "dtype": "dtype", "device": "device",
    "scheme": "quant.scheme", "method": "quant.method", "group_size": "quant.group_size", "sym": "quant.symmetric",
    "ignore": "quant.ignore", "clip_search": "quant.clip_search", "kv_cache": "quant.kv_cache",
    "damp": "quant.gptq.damp", "block_size": "quant.gptq.block_size", "actorder": "quant.gptq.actorder",
    "static_groups": "quant.gptq.static_groups", "gptq_holdout": "quant.gptq.holdout",
    "awq_grid": "quant.awq.grid", "awq_duo": "quant.awq.duo", "awq_clip": "quant.awq.clip",
    "awq_search_tokens": "quant.awq.search_tokens", "awq_fallback": "quant.awq.fallback",
    "awq_holdout": "quant.awq.holdout", "awq_tolerance": "quant.awq.tolerance",
    "awq_clip_prior_tokens": "quant.awq.clip_prior_tokens",
    "calib": "calibration.spec", "num_samples": "calibration.num_samples", "seq_len": "calibration.seq_len",
    "seed": "calibration.seed", "calib_cut": "calibration.cut", "text_field": "calibration.text_field",
    "min_tokens": "calibration.min_tokens", "smooth": "quant.smooth", "smooth_alpha": "quant.smooth_alpha",
    "moe_calibrate_all": "quant.moe.calibrate_all_experts", "moe_min_tokens": "quant.moe.min_tokens",
    "bits": "quant.bits", "full_range": "quant.full_range",
    "signround_iters": "quant.signround.iters", "signround_lr": "quant.signround.lr",
    "signround_batch": "quant.signround.batch", "signround_clip": "quant.signround.clip",
    "signround_holdout": "quant.signround.holdout", "signround_float_targets": "quant.signround.float_targets",
    "signround_keep_best": "quant.signround.keep_best",
}


@app.command("quantize")
def quantize(
    model: Optional[str] = typer.Argument(None, help="Hugging Face folder or hub id; omit for the embedded SmolLM2-135M."),
    output: Optional[str] = typer.Option(None, "-o", "--output", help="Checkpoint folder to write."),
    recipe: Optional[str] = typer.Option(None, "--recipe", help="Recipe YAML; flags given here override it."),
    scheme: Optional[str] = typer.Option(None, help="w4a16, w8a16, w3a16 (group 64), w2a16 (group 32), fp8, fp8-dynamic, w8a8 (INT8 weights and per-token activations), w8a8-static, nvfp4 or mxfp4 (4-bit float weights), nvfp4-a4 (4-bit float weights and activations)."),
    method: Optional[str] = typer.Option(None, help="auto (default: awq+gptq for 4-bit-or-fewer integer weights on a mapped architecture, awq alone below 32768 calibration tokens, else rtn), rtn, gptq, awq, awq+gptq or signround (learned rounding)."),
    group_size: Optional[int] = typer.Option(None, "--group-size", help="32, 64, 128 or -1 (per channel)."),
    bits: Optional[float] = typer.Option(None, "--bits", help="Average bits per weight, scales included (e.g. 4.5): each Linear gets 3, 4 or 8 bits by its measured rounding sensitivity."),
    sym: Optional[bool] = typer.Option(None, "--sym/--asym", help="Symmetric grid (default) or with zero points."),
    full_range: Optional[bool] = typer.Option(None, "--full-range/--no-full-range", help="Symmetric 2-4 bit weights: the group's largest weight on the grid's negative end, steps of absmax/8 (on)."),
    ignore: Optional[list[str]] = typer.Option(None, "--ignore", help="Module name glob or re:regex kept in float (repeatable; lm_head always by default)."),
    clip_search: Optional[bool] = typer.Option(None, "--clip-search/--no-clip-search", help="MSE search of each group's clipping range."),
    damp: Optional[float] = typer.Option(None, help="GPTQ dampening, fraction of mean Hessian diagonal (0.01)."),
    block_size: Optional[int] = typer.Option(None, "--block-size", help="GPTQ lazy-update block (128)."),
    actorder: Optional[str] = typer.Option(None, help="GPTQ act-order: off or weight (columns by decreasing Hessian diagonal, no g_idx)."),
    static_groups: Optional[bool] = typer.Option(None, "--static-groups/--no-static-groups", help="GPTQ act-order weight: group scales from the original weights (default) or as updated."),
    awq_grid: Optional[int] = typer.Option(None, "--awq-grid", help="AWQ alpha grid points (20)."),
    awq_duo: Optional[bool] = typer.Option(None, "--awq-duo/--no-awq-duo", help="AWQ duo scaling form."),
    awq_clip: Optional[bool] = typer.Option(None, "--awq-clip/--no-awq-clip", help="AWQ per-group clip search after scaling (on)."),
    awq_search_tokens: Optional[int] = typer.Option(None, "--awq-search-tokens", help="Calibration tokens AWQ's alpha search runs per layer (2048)."),
    awq_fallback: Optional[str] = typer.Option(None, "--awq-fallback", help="error or rtn, for unmapped architectures."),
    gptq_holdout: Optional[float] = typer.Option(None, "--gptq-holdout", help="Share of calibration samples GPTQ keeps out of its Hessian to check act-order and GPTQ itself against plain RTN (0.1; 0 = off)."),
    awq_tolerance: Optional[float] = typer.Option(None, "--awq-tolerance", help="AWQ keeps the mildest alpha within this share of the best block error (0.1; 0 = the best)."),
    awq_clip_prior_tokens: Optional[int] = typer.Option(None, "--awq-clip-prior-tokens", help="AWQ's clip drops prior / (prior + calibration tokens) of each Gram block's off-diagonal part (2048; 0 = off)."),
    awq_holdout: Optional[float] = typer.Option(None, "--awq-holdout", help="Share of calibration samples AWQ keeps out of its search to check its scales and clips against plain RTN (0.2; 0 = off)."),
    kv_cache: Optional[str] = typer.Option(None, "--kv-cache", help="fp8: calibrate an FP8 KV cache."),
    smooth: Optional[bool] = typer.Option(None, "--smooth/--no-smooth", help="SmoothQuant before a w8a8 scheme (needs --calib)."),
    smooth_alpha: Optional[float] = typer.Option(None, "--smooth-alpha", help="SmoothQuant migration strength in [0, 1]; default searched per layer."),
    moe_calibrate_all: Optional[bool] = typer.Option(None, "--moe-calibrate-all/--moe-routed-only", help="MoE: calibrate every expert on every token (routed output kept) or only on its routed tokens (default)."),
    moe_min_tokens: Optional[int] = typer.Option(None, "--moe-min-tokens", help="MoE: experts fed fewer calibration tokens are rounded (RTN), reported (16)."),
    signround_iters: Optional[int] = typer.Option(None, "--signround-iters", help="Learned rounding: signed-gradient steps per layer (40)."),
    signround_lr: Optional[float] = typer.Option(None, "--signround-lr", help="Learned rounding: step size, decaying linearly (1/iters)."),
    signround_batch: Optional[int] = typer.Option(None, "--signround-batch", help="Learned rounding: calibration samples per step (2)."),
    signround_clip: Optional[bool] = typer.Option(None, "--signround-clip/--no-signround-clip", help="Learned rounding: also learn each group's clip factors (on)."),
    signround_holdout: Optional[float] = typer.Option(None, "--signround-holdout", help="Learned rounding: share of samples held out to check it beats RTN (0.125)."),
    signround_float_targets: Optional[bool] = typer.Option(None, "--signround-float-targets/--no-signround-float-targets", help="Learned rounding: fit each layer to the unquantised model's output (off)."),
    signround_keep_best: Optional[bool] = typer.Option(None, "--signround-keep-best/--no-signround-keep-best", help="Learned rounding: end on the step with the lowest batch loss (off)."),
    calib: Optional[str] = typer.Option(None, "--calib", help="Calibration data: dataset name, file, folder or 'self'."),
    num_samples: Optional[int] = typer.Option(None, "--num-samples", help="Calibration samples (128)."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="Tokens per calibration sample (512)."),
    seed: Optional[int] = typer.Option(None, help="Calibration seed (0)."),
    calib_cut: Optional[str] = typer.Option(None, "--calib-cut", help="chunk (concatenate and cut) or document."),
    text_field: Optional[str] = typer.Option(None, "--text-field", help="Text field of JSON/CSV/parquet data."),
    min_tokens: Optional[int] = typer.Option(None, "--min-tokens", help="Shortest document kept in document mode."),
    dtype: Optional[str] = typer.Option(None, help="auto, float16, bfloat16 or float32."),
    device: Optional[str] = typer.Option(None, help="auto (CUDA when this torch sees a GPU, else CPU), cpu, cuda or cuda:N: one layer at a time on the device (default: the recipe's, cpu)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a non-empty OUT."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON summary on stdout."),
):
    """Quantise MODEL and write a compressed-tensors checkpoint to OUT.

    Example: quantkit quantize ./my-model -o ./my-model-w4 --scheme w4a16 --group-size 128
    """
    from ..recipe import Recipe, apply_overrides, load_recipe

    base = load_recipe(recipe) if recipe else Recipe()
    if device is not None:
        from ..runtime.build import resolve_device
        device = resolve_device(device)
    # every option named in FLAG_FIELDS, as given (None: "as the recipe says")
    flags = {k: v for k, v in locals().items() if k in FLAG_FIELDS}
    flags.update(overwrite=overwrite or None, ignore=list(ignore) if ignore else None)  # a plain switch; a list
    _run(apply_overrides(base, {FLAG_FIELDS[k]: v for k, v in flags.items()}), quiet, as_json)


@app.command("demo")
def demo(
    output: str = typer.Option("smollm2-w4", "-o", "--output", help="Checkpoint folder to write."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a non-empty OUT."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON summary on stdout."),
):
    """Quantise the embedded SmolLM2-135M-Instruct to W4 (group 64, RTN); nothing is downloaded.

    Example: quantkit demo -o smollm2-w4 && quantkit inspect smollm2-w4
    """
    from ..recipe import Recipe, apply_overrides

    # RTN on purpose: the demo is the seconds-long first try; `quantize` without --method calibrates (auto)
    r = apply_overrides(Recipe(), {"output": output, "overwrite": overwrite or None, "quant.group_size": 64,
                                   "quant.method": "rtn"})
    _run(r, quiet, as_json)
