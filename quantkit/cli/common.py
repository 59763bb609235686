"""Helpers shared by the commands: JSON output and the rich console."""
from __future__ import annotations

import json
import sys

from rich.console import Console

console = Console(stderr=True)


def emit_json(data) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
