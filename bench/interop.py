"""Suite `interop`: vLLM's CPU build against transformers (or quantkit's runtime) on every checkpoint option
quantkit writes: the matrix of quantkit/evaluate/interop.py (tests/test_vllm_interop.py gates a subset of it),
one row per case and serving dtype, scored on the same windows of bench/data/eval_prose.txt.

The venv comes from `bash bench/vllm_env.sh` (or QUANTKIT_VLLM_PYTHON); checkpoints are written under
bench/out/vllm-interop/. --quick: the symmetric W4 g64 RTN case only.
"""
from __future__ import annotations

from pathlib import Path

from quantkit.evaluate import interop

from .script_suite import parse_tables

HERE = Path(__file__).resolve().parent
ROWS = [{"name": f"{c.name}, {c.dtype}", "case": i} for i, c in enumerate(interop.CASES)]


def run(rows: list[dict], quick: bool) -> dict:
    from quantkit.evaluate.backends import vllm_python
    from quantkit.shipped import shipped_dir

    if quick:
        rows = rows[:1]
    cases = [interop.CASES[r["case"]] for r in rows]
    out = HERE / "out" / "vllm-interop"
    texts = shipped_dir("calibration") / "texts"
    paths = [interop.build(c, out / interop.case_dir(c), texts) for c in cases]
    windows, prompts = interop.eval_tokens(HERE / "data" / "eval_prose.txt")
    table, _ = parse_tables(interop.markdown(interop.run(cases, paths, windows, prompts, 16, vllm_python(None))))
    return {"setup": {"windows": "up to 16 x 128 tokens of eval_prose.txt", "greedy prompts": 2, "new tokens": 16},
            "rows": table}
