"""The `quantkit` command: thin typer commands that parse arguments and call the library.

Each command lives in its own module and registers itself on `app`; UserError becomes one line on stderr
and exit code 2, so scripts can tell bad input from a crash.
"""
from __future__ import annotations

import os
import sys

from .common import app  # noqa: F401  (the typer app every command registers on)

def _register() -> None:
    # Imported for their @app.command side effect; kept in one place so the command list is visible.
    from . import (draft_cmd, estimate_cmd, eval_cmd, generate_cmd, inspect_cmd, quantize_cmd, recipe_cmd,  # noqa: F401
                   serve_cmd, verify_cmd)


def _quiet_libraries() -> None:
    """transformers' load reports and download bars would bury our one-line errors and our own progress."""

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def main() -> None:
    from ..errors import UserError

    _quiet_libraries()
    _register()
    hard = False
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun started this process
        from .. import distributed

        hard = distributed.exit_hard_when_launched()
    try:
        app()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        code = e.exit_code
    except SystemExit as e:
        if not hard:
            raise
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    else:
        code = 0
    if hard:  # under torchrun: no C++ teardown after the run (distributed.exit_hard_when_launched says why)
        distributed.exit_process(code)
    sys.exit(code)
