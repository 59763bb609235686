"""`quantkit quantize` and `quantkit demo`."""
from __future__ import annotations

import os
from typing import Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .common import app, console, emit_json
from .legacy_flags import WithLegacyFlags
from .set_option import SET_HELP, fields_help, parse_set


def _progress(quiet: bool):
    if quiet:
        return None
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=False)


def _run(recipe, quiet: bool, as_json: bool) -> None:
    from ..job import quantize_to_checkpoint

    if int(os.environ.get("RANK", "0")) > 0:  # under torchrun rank 0 alone shows progress and the summary
        quiet, as_json = True, False
    prog = _progress(quiet or as_json)
    if prog is None:
        summary = quantize_to_checkpoint(recipe)
    else:
        with prog:
            summary = quantize_to_checkpoint(recipe, progress=prog)
    if as_json:
        emit_json(summary)
    elif not quiet and summary["output"] is not None:
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


# quantize's own options -> the recipe fields they set; every other field is reached by --set
# (tests/test_cli_recipe_parity.py checks that each field is, and that --help lists it)
FLAG_FIELDS = {
    "model": "model", "output": "output", "overwrite": "overwrite", "dtype": "dtype", "device": "device",
    "scheme": "quant.scheme", "method": "quant.method", "group_size": "quant.group_size", "bits": "quant.bits",
    "ignore": "quant.ignore", "calib": "calibration.spec", "num_samples": "calibration.num_samples",
    "seq_len": "calibration.seq_len", "max_memory": "max_memory",
}
# sections quantize does not read: `quantkit run` evaluates and trains drafts
NOT_QUANTIZE = ("eval", "draft")


def _recipe(recipe_path: str | None, sets: list[str], flags: dict):
    """The recipe file (or the defaults), then --set, then the explicit options: the last one given wins."""
    from ..errors import UserError
    from ..recipe import Recipe, apply_overrides, load_recipe

    overrides = parse_set(sets)
    for key in overrides:
        if key.split(".")[0] in NOT_QUANTIZE:
            raise UserError(f"--set {key}: quantize does not read '{key.split('.')[0]}'; use quantkit run RECIPE "
                            f"--set {key}=...")
    r = apply_overrides(load_recipe(recipe_path) if recipe_path else Recipe(), overrides)
    r = apply_overrides(r, {FLAG_FIELDS[k]: v for k, v in flags.items()})
    if r.device != "cpu":  # auto becomes cuda or cpu, and a missing GPU is a one-line error before any loading
        from ..devices import resolve_device

        r = apply_overrides(r, {"device": resolve_device(r.device)})
    return r


@app.command("quantize", cls=WithLegacyFlags, epilog=fields_help(skip=NOT_QUANTIZE))
def quantize(
    model: Optional[str] = typer.Argument(None, help="Hugging Face folder or hub id; omit for the embedded SmolLM2-135M."),
    output: Optional[str] = typer.Option(None, "-o", "--output", help="Checkpoint folder to write."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a non-empty OUT."),
    recipe: Optional[str] = typer.Option(None, "--recipe", help="Recipe YAML; --set and the options here override it."),
    scheme: Optional[str] = typer.Option(None, help="w4a16, w8a16, w3a16 (group 64), w2a16 (group 32), fp8, fp8-dynamic, w8a8 (INT8 weights and per-token activations), w8a8-static, nvfp4 or mxfp4 (4-bit float weights), nvfp4-a4 (4-bit float weights and activations)."),
    method: Optional[str] = typer.Option(None, help="auto (default: awq+gptq for 4-bit-or-fewer integer weights on a mapped architecture, else rtn), rtn, gptq, awq, awq+gptq or signround (learned rounding)."),
    group_size: Optional[int] = typer.Option(None, "--group-size", help="32, 64, 128 or -1 (per channel)."),
    bits: Optional[float] = typer.Option(None, "--bits", help="Average bits per weight, scales included (e.g. 4.5): each Linear gets 3, 4 or 8 bits by its measured rounding sensitivity."),
    calib: Optional[str] = typer.Option(None, "--calib", help="Calibration data: dataset name, file, folder or 'self' (default)."),
    num_samples: Optional[int] = typer.Option(None, "--num-samples", help="Calibration samples (128)."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="Tokens per calibration sample (512)."),
    ignore: Optional[list[str]] = typer.Option(None, "--ignore", help="Module name glob or re:regex kept in float (repeatable; lm_head always by default)."),
    device: Optional[str] = typer.Option(None, help="auto (CUDA when this torch sees a GPU, else CPU), cpu, cuda or cuda:N: one layer at a time on the device (default: the recipe's, cpu)."),
    dtype: Optional[str] = typer.Option(None, help="auto, float16, bfloat16 or float32."),
    max_memory: Optional[str] = typer.Option(None, "--max-memory", help="What quantkit may hold, per device as accelerate writes it: 2GiB, or cpu=2GiB,cuda:0=70GiB (default: what is free). A float model that does not fit self-calibrates with a W8 (else W4) round-to-nearest copy built layer by layer."),
    set_: Optional[list[str]] = typer.Option(None, "--set", help=SET_HELP + " The fields are listed below."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON summary on stdout."),
    fmt: Optional[str] = typer.Option(None, "--format", help="compressed-tensors (default) or gguf: one OUT.gguf file for llama.cpp, --scheme q4_k_m (default), q5_k_m, q3_k_m, q6_k, q8_0, q4_0, q4_1, or f16 (unquantised, the input of llama.cpp's own llama-quantize); --method auto (default: the block encoder's scale search with each input column's mean squared activation on the calibration text weighing its rounding error, llama.cpp's importance-matrix idea), rtn (the same search, no data) or gptq (on each block's fixed grid, every type but IQ4_NL); awq and signround do not run on GGUF grids yet (docs/gguf.md)."),
):
    """Quantise MODEL and write a compressed-tensors checkpoint to OUT (or a GGUF file with --format gguf).

    Example: quantkit quantize ./my-model -o ./my-model-w4 --scheme w4a16 --group-size 128 --set quant.gptq.damp=0.05
    """
    if fmt not in (None, "compressed-tensors"):
        from .gguf_option import run_gguf

        return run_gguf(fmt, {k: v for k, v in locals().items() if k in FLAG_FIELDS or k in ("recipe", "set_")}, as_json)
    # every option named in FLAG_FIELDS, as given (None: "as the recipe says")
    flags = {k: v for k, v in locals().items() if k in FLAG_FIELDS}
    flags.update(overwrite=overwrite or None, ignore=list(ignore) if ignore else None)  # a plain switch; a list
    _run(_recipe(recipe, set_ or [], flags), quiet, as_json)


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
