"""vLLM (CPU build) against transformers on every checkpoint option quantkit writes; prints the table.

Usage: python bench/vllm_interop.py [--vllm-python .venv-vllm/bin/python] [--out bench/out/vllm-interop]
       [--only NAME] [--json FILE]
The venv comes from `bash bench/vllm_env.sh`. Same matrix and comparison as tests/test_vllm_interop.py
(quantkit/evaluate/interop.py); this script only prints the table docs/vllm.md carries.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from quantkit.evaluate import interop  # noqa: E402
from quantkit.evaluate.backends import vllm_python  # noqa: E402
from quantkit.shipped import shipped_dir  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--out", default=str(Path(__file__).parent / "out" / "vllm-interop"))
    ap.add_argument("--only", help="cases whose name contains this")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--reuse", action="store_true", help="score checkpoints already in --out instead of rebuilding")
    a = ap.parse_args()
    python = vllm_python(a.vllm_python)
    cases = [c for c in interop.CASES if not a.only or a.only in c.name]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    texts = shipped_dir("calibration") / "texts"
    paths = [out / interop.case_dir(c) if a.reuse and (out / interop.case_dir(c) / "quantkit.json").is_file()
             else interop.build(c, out / interop.case_dir(c), texts) for c in cases]
    t1 = time.time()
    windows, prompts = interop.eval_tokens(Path(__file__).parent / "data" / "eval_prose.txt")
    rows = interop.run(cases, paths, windows, prompts, 16, python)
    print(interop.markdown(rows))
    print(f"quantise {t1 - t0:.0f} s, score {time.time() - t1:.0f} s")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
