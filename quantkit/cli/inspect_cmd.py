"""`quantkit inspect`: a per-layer-type summary by default, every Linear with --all, everything with --json."""
from __future__ import annotations

from pathlib import Path

import typer

from .common import app, emit_json
from .text_table import fill, render, terminal_width


def _mb(n) -> str:
    return "-" if n is None else f"{n / 1e6:.1f} MB"


def _err(v) -> str:
    return "-" if v is None else f"{v:.4f}"


def _scheme(r: dict) -> str:
    # per-channel (-1) and unrecorded group sizes add nothing a reader could compare
    g = r["group_size"]
    return f"{r['scheme']} g{g}" if isinstance(g, int) and g > 0 else r["scheme"]


def _summary(info: dict, width: int) -> list[str]:
    types = info["layer_types"]
    has_out = any(t["output_rel_error"] for t in types)
    heads = ["layer type", "n", "scheme", "bits/w", "err min", "median", "max"] + ["out err"] * has_out
    rows = []
    for t in types:
        w = t["weight_rel_error"] or {}
        cells = [f"x{t['count']}", _scheme(t), f"{t['bits_per_weight']:.2f}",
                 _err(w.get("min")), _err(w.get("median")), _err(w.get("max"))]
        rows.append((t["type"], cells + [_err((t["output_rel_error"] or {}).get("median"))] * has_out))
    legend = ("err: relative weight error over the layers of a type" +
              ("; out err: median relative output error" if has_out else "") +
              ". Every layer: quantkit inspect --all; every figure: --json")
    return render(heads, rows, width) + [fill(legend, width)]


def _every_layer(info: dict, width: int) -> list[str]:
    from ..inspect_ckpt import solver_summary

    has_out = any(r["output_rel_error"] is not None for r in info["layers"])
    rows = [(r["layer"], [_scheme(r), f"{r['bits_per_weight']:.2f}", _err(r["weight_rel_error"])]
             + [_err(r["output_rel_error"])] * has_out) for r in info["layers"]]
    notes = [s if s != "-" else "" for s in (solver_summary(r["solver"]) for r in info["layers"])]
    return render(["layer", "scheme", "bits/w", "err"] + ["out err"] * has_out, rows, width, notes)


def _footer(info: dict) -> list[str]:
    ratio = f" ({info['compression']}x smaller)" if info["compression"] else ""
    out = [f"checkpoint {_mb(info['total_bytes'])} vs original {_mb(info['source_bytes'])}{ratio}; "
           f"{info['float_share']:.1%} of the parameters in float"]
    if info["method_reason"]:
        out.append(f"method {info['method_reason']}")
    full = sum(1 for r in info["layers"] if r["solver"].get("grid") == "full range")
    if full:  # one line, not a column: it is the grid's rule, the same for every layer the scheme covers
        out.append(f"full-range grid on {full} of {len(info['layers'])} layers: each group's largest weight on "
                   "code -2^(b-1), signed scales")
    if info["bit_budget"]:
        b = info["bit_budget"]
        out.append(f"--bits {b['target']}: {info['average_bits_per_weight']:.3f} bits per quantised weight "
                   f"(widths chosen per layer by rounding sensitivity, quantkit.json bit_budget)")
    if info["moe"]:
        m = info["moe"]
        out.append(f"experts: {m['experts']} quantised, fewest calibration tokens routed to one: "
                   f"{m['fewest_routed_tokens']}, rounded for lack of tokens: {m['rtn_fallback']}")
    return out


@app.command("inspect")
def inspect(
    path: str = typer.Argument(..., help="Checkpoint folder written by quantkit quantize, or a .gguf file."),
    every_layer: bool = typer.Option(False, "--all", help="One row per quantised Linear, with what its solver did."),
    as_json: bool = typer.Option(False, "--json", help="Every figure: each layer, the per-type summary, sizes."),
):
    """Show bits per weight (scales included), error and size: one row per layer type, or per Linear with --all.

    Example: quantkit inspect ./my-model-w4 --all

    A GGUF file: its block types, bits per weight and bytes per tensor kind (one row per tensor with --all).
    Example: quantkit inspect ./my-model-q4_k_m.gguf
    """
    from ..inspect_ckpt import inspect_checkpoint

    if path.endswith(".gguf"):
        _gguf(path, every_layer, as_json)
        return
    info = inspect_checkpoint(path)
    if as_json:
        emit_json(info)
        return
    width = terminal_width()
    name = Path(info["checkpoint"]).resolve().name
    lines = [fill(f"{name}: {info['format']}, method {info['method'] or '?'}, "
                  f"{len(info['layers'])} quantised Linears", width), ""]
    lines += _every_layer(info, width) if every_layer else _summary(info, width)
    lines += [fill(line, width) for line in _footer(info)]
    typer.echo("\n".join(lines))


def _gguf(path: str, every_layer: bool, as_json: bool) -> None:
    from ..inspect_gguf import inspect_gguf, types_text

    info = inspect_gguf(path)
    if as_json:
        emit_json(info)
        return
    width = terminal_width()
    lines = [fill(f"{Path(path).name}: gguf {info['file_type'] or '?'}, {info['architecture'] or '?'}, "
                  f"{len(info['tensors'])} tensors", width), ""]
    if every_layer:
        rows = [(t["name"], [t["type"], "x".join(map(str, t["shape"])), f"{t['bits_per_weight']:.2f}"])
                for t in info["tensors"]]
        lines += render(["tensor", "type", "shape", "bits/w"], rows, width)
    else:
        rows = [(k["kind"], [f"x{k['count']}", types_text(k["types"]), f"{k['bits_per_weight']:.2f}", _mb(k["bytes"])])
                for k in info["kinds"]]
        lines += render(["tensor kind", "n", "types", "bits/w", "size"], rows, width)
    f16 = 2 * info["parameters"]
    lines += [fill(f"file {_mb(info['file_bytes'])}: {info['parameters']:,} weights at {info['bits_per_weight']:.2f} "
                   f"bits each (float16: {_mb(f16)}, {f16 / info['file_bytes']:.2f}x smaller); block scales "
                   "included. Every tensor: --all; every figure: --json", width)]
    typer.echo("\n".join(lines))
