"""Suite `serving`: `quantkit serve` against vLLM's CPU build on the W4 g64 demo checkpoint, tokens/s at 1 and
16 concurrent requests (bench/serve_vs_vllm.py; vLLM's venv from `bash bench/vllm_env.sh`)."""
from __future__ import annotations

from .script_suite import run_rows, venv_missing

ROWS = [{"name": "w4 g64 rtn", "script": "serve_vs_vllm.py", "args": ["--repeat", "3"], "needs": venv_missing(".venv-vllm/bin/python"),
         "quick": ["--concurrency", "1", "4", "--requests", "4"]}]


def run(rows: list[dict], quick: bool) -> dict:
    return run_rows(rows, quick)
