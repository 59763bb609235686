"""What the commands share: the typer app they register on, JSON output and the rich console."""
from __future__ import annotations

import json
import sys

import typer
from rich.console import Console

console = Console(stderr=True)

# the one typer app; each *_cmd module registers its command on it (cli/__init__.py imports them all)
app = typer.Typer(
    name="quantkit",
    help="Post-training quantisation for Hugging Face causal LMs.\n\nExample: quantkit quantize ./my-model -o ./my-model-w4 --scheme w4a16",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def emit_json(data) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
