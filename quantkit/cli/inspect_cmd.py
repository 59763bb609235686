"""`quantkit inspect`."""
from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

from .common import app, emit_json


def _mb(n) -> str:
    return "-" if n is None else f"{n / 1e6:.1f} MB"


@app.command("inspect")
def inspect(
    path: str = typer.Argument(..., help="Checkpoint folder written by quantkit quantize."),
    as_json: bool = typer.Option(False, "--json", help="Print the same data as JSON."),
):
    """Show each quantised layer's scheme, bits per weight (scales included) and error, and the total size.

    Example: quantkit inspect ./my-model-w4 --json
    """
    from ..inspect_ckpt import inspect_checkpoint, solver_summary

    info = inspect_checkpoint(path)
    if as_json:
        emit_json(info)
        return
    t = Table(title=f"{info['checkpoint']} ({info['format']}, {info['method'] or '?'})")
    summaries = [solver_summary(r["solver"]) for r in info["layers"]]
    solver_col = any(x != "-" for x in summaries)  # plain rounding records nothing: no column to fill with dashes
    for col in ("layer", "scheme", "bits", "group", "bits/weight", "weight err", "output err") + ("solver",) * solver_col:
        t.add_column(col, justify="left" if col in ("layer", "solver") else "right")
    fmt = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
    for r, summary in zip(info["layers"], summaries):
        t.add_row(r["layer"], r["scheme"], str(r["bits"]), str(r["group_size"]), f"{r['bits_per_weight']:.2f}",
                  fmt(r["weight_rel_error"]), fmt(r["output_rel_error"]), *([summary] * solver_col))
    out = Console()
    out.print(t)
    ratio = f" ({info['compression']}x smaller)" if info["compression"] else ""
    out.print(f"checkpoint {_mb(info['total_bytes'])} vs original {_mb(info['source_bytes'])}{ratio}; "
              f"{info['float_share']:.1%} of the parameters in float")
    if info["method_reason"]:
        out.print(f"method {info['method_reason']}")
    full = sum(1 for r in info["layers"] if r["solver"].get("grid") == "full range")
    if full:  # one line, not a column: it is the grid's rule, the same for every layer the scheme covers
        out.print(f"full-range grid on {full} of {len(info['layers'])} layers: each group's largest weight on "
                  "code -2^(b-1), signed scales")
    if info["bit_budget"]:
        b = info["bit_budget"]
        out.print(f"--bits {b['target']}: {info['average_bits_per_weight']:.3f} bits per quantised weight "
                  f"(widths chosen per layer by rounding sensitivity, quantkit.json bit_budget)")
    if info["moe"]:
        m = info["moe"]
        out.print(f"experts: {m['experts']} quantised, fewest calibration tokens routed to one: "
                  f"{m['fewest_routed_tokens']}, rounded for lack of tokens: {m['rtn_fallback']}")
