"""`quantkit estimate`: roofline sizing of a model from its config alone."""
from __future__ import annotations

from typing import Optional

import typer

from .common import app, console, emit_json


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


@app.command("estimate")
def estimate(
    model: str = typer.Argument(..., help="config.json, a model folder, or a cached hub id."),
    gpu: str = typer.Option("h100", "--gpu", help="h100, h100-pcie, h200, a100, a100-40gb, l40s, l4, a10g, rtx4090, mi300x."),
    precision: str = typer.Option("bf16,fp8,int4", "--precision", help="Comma list of bf16, fp16, fp8, int8, w8a8, int4, nvfp4, mxfp4 (int8: weight-only; w8a8: int8 activations too)."),
    context: int = typer.Option(4096, "--context", help="Tokens of context per sequence."),
    batch: int = typer.Option(1, "--batch", help="Sequences decoded together."),
    kv_dtype: str = typer.Option("bf16", "--kv-dtype", help="KV cache dtype: bf16, fp16 or fp8."),
    group_size: int = typer.Option(128, "--group-size", help="int4 group size (one 16-bit scale per group)."),
    method: str = typer.Option("gptq", "--method", help="Quantisation run to time: gptq or rtn."),
    ranks: int = typer.Option(1, "--ranks", help="Processes the run is shared by (torchrun --nproc-per-node x --nnodes)."),
    nodes: int = typer.Option(1, "--nodes", help="Machines the ranks are spread over (100 Gb/s-class links between them)."),
    device: str = typer.Option("cpu", "--device", help="Where each rank quantises: cpu (measured costs) or a --gpu name (memory only)."),
    num_samples: int = typer.Option(128, "--num-samples", help="Calibration samples of the run."),
    seq_len: int = typer.Option(512, "--seq-len", help="Tokens per calibration sample."),
    max_memory: Optional[str] = typer.Option(None, "--max-memory", help="What each rank may hold, as quantize takes it (e.g. cpu=64GiB, or cuda=70GiB with --device h100): calibration activations past a quarter of it are counted on disk, as the run keeps them."),
    as_json: bool = typer.Option(False, "--json", help="Print the estimate as JSON on stdout."),
):
    """Weight bytes, KV bytes, GPUs needed and bandwidth-bound decode tokens/s, per precision.

    Example: quantkit estimate meta-llama/Meta-Llama-3-70B --gpu h100 --precision bf16,fp8,int4 --context 8192
    """
    from rich.table import Table

    from ..evaluate.estimate import estimate as run, load_config
    from ..evaluate.run_cost import quantize_estimate

    precisions = [p.strip().lower() for p in precision.split(",") if p.strip()]
    cfg = load_config(model)
    result = run(cfg, gpu, precisions, context, batch, kv_dtype.lower(), group_size)
    result["quantize"] = quantize_estimate(cfg, method.lower(), num_samples, seq_len, ranks, nodes, device.lower(),
                                           _cap(max_memory, device.lower()))
    if as_json:
        emit_json(result)
        return
    t = Table(title=f"{model} on {gpu} ({result['params'] / 1e9:.2f}B params, context {context}, batch {batch}, "
                    f"KV {kv_dtype})")
    for col in ("precision", "weights", "KV / token", "KV total", "GPUs", "tokens/s (1 stream)",
                "prefill tokens/s (compute)"):
        t.add_column(col, justify="left" if col == "precision" else "right")
    for p, r in result["precisions"].items():
        t.add_row(p, _gb(r["weight_bytes"]), f"{r['kv_bytes_per_token'] / 1024:.0f} KiB", _gb(r["kv_bytes"]),
                  str(r["gpus"]), f"{r['tokens_per_s']:.1f}",
                  "-" if r["prefill_tokens_per_s"] is None
                  else f"{r['prefill_tokens_per_s']:.0f} ({r['prefill_compute']})")
    console.print(t)
    _print_run(result["quantize"])
    console.print(f"[dim]upper bounds: decode reads all weights and the KV cache once per step; "
                  f"{result['usable_fraction']:.0%} of each GPU's memory counted as usable; prefill at the datasheet "
                  f"tensor-core peak of the type the products run in[/]")


def _cap(max_memory: str | None, device: str) -> int | None:
    from ..errors import UserError
    from ..recipe.memory_cap import cap_for, parse_max_memory

    if max_memory is None:
        return None
    try:
        return cap_for(parse_max_memory(max_memory), "cpu" if device == "cpu" else "cuda")
    except ValueError as e:
        raise UserError(f"--max-memory: {e}") from None


def _print_run(q: dict) -> None:
    mem = q["memory"]
    parts = ", ".join(f"{k.replace('_', ' ')} {_gb(v)}" for k, v in mem.items()
                      if k not in ("total", "activations_on_disk"))
    if mem.get("activations_on_disk"):
        parts += f"; activations on disk {_gb(mem['activations_on_disk'])}"
    time = "not measured for this device" if q["seconds"] is None else f"{q['seconds'] / 60:.1f} min"
    console.print(f"quantise ({q['method']}, {q['samples']} x {q['seq_len']} tokens, {q['ranks']} rank(s) on "
                  f"{q['nodes']} node(s), {q['device']}): about {time}; peak memory per rank {_gb(mem['total'])} "
                  f"({parts})")
