"""Suite `kernels`: the CPU packed int4/int8 products against float matmuls (bench/kernels_cpu.py), and where a
GPU is, quantkit's W4A16 kernels (bench/kernels_gpu.py) and FP8 against bf16 matmuls (bench/fp8_gpu.py)."""
from __future__ import annotations

from .script_suite import no_gpu, run_rows

ROWS = [
    {"name": "cpu", "script": "kernels_cpu.py", "args": ["--threads", "1"], "quick": ["--shapes", "1024x1024,2048x2048"]},
    {"name": "gpu w4a16", "script": "kernels_gpu.py", "needs": no_gpu, "quick": ["--quick"]},
    {"name": "gpu fp8", "script": "fp8_gpu.py", "needs": no_gpu},
]


def run(rows: list[dict], quick: bool) -> dict:
    return run_rows(rows, quick)
