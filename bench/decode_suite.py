"""Suite `decode`: batch-1 decode speed against the weight-reading limit and transformers' generate
(bench/decode.py on the CPU, bench/decode_gpu.py where a GPU is), on the embedded SmolLM2-135M and its W4 g64
RTN checkpoint (`quantkit demo`, made once under bench/out/)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from .script_suite import no_gpu, run_rows

W4 = Path(__file__).resolve().parent / "out" / "demo-w4"
ROWS = [
    {"name": "cpu", "script": "decode.py",
     "args": ["--prompts", "2", "--tokens", "48", "--threads", "2", "--compile", "--w4", str(W4)],
     "quick": ["--tokens", "16"]},
    # the same CPU run as one without AVX-512 and AMX (an AVX2 machine): what torch's kernels do there
    {"name": "cpu avx2 cap", "script": "decode.py",
     "env": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
     "args": ["--prompts", "2", "--tokens", "48", "--threads", "2", "--compile", "--no-transformers", "--w4", str(W4)],
     "quick": ["--tokens", "16"]},
    {"name": "gpu", "script": "decode_gpu.py", "needs": no_gpu, "quick": ["--prompts", "1"]},
]


def run(rows: list[dict], quick: bool) -> dict:
    if not (W4 / "config.json").exists():
        p = subprocess.run([sys.executable, "-m", "quantkit", "demo", "-o", str(W4), "-q"], capture_output=True, text=True)
        if p.returncode:
            from quantkit.errors import UserError

            raise UserError(f"`quantkit demo -o {W4}` failed ({p.stderr.strip().splitlines()[-1:]}); fix it, or "
                            "give decode a checkpoint there")
    return run_rows(rows, quick)
