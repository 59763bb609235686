"""`quantkit verify`."""
from __future__ import annotations

import typer

from .common import app, emit_json


@app.command("verify")
def verify(
    path: str = typer.Argument(..., help="Checkpoint folder written by quantkit quantize."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON (for CI)."),
):
    """Check a checkpoint's files against the sha256 manifest in its quantkit.json, then run every check a load
    makes (headers, config, tensor shapes, dtypes and values). Exit 0: all good; 1: files differ from the
    manifest; 2: the checkpoint fails the load checks.

    Example: quantkit verify ./my-model-w4 --json
    """
    from ..verify_ckpt import verify_checkpoint

    report = verify_checkpoint(path)
    if as_json:
        emit_json(report)
    else:
        m, err = report["manifest"], report["integrity"]["error"]
        for p in m["problems"] or [f"{m['files_checked']} files match"]:
            typer.echo(f"manifest: {p}")
        typer.echo(f"load checks: {err or 'pass'}")
    raise typer.Exit(report["exit_code"])
