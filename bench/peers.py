"""Suite `peers`: other libraries on the quality suite's model, scheme and tokens: llm-compressor's GPTQ and AWQ
(bench/quality_llmcompressor.py, run by a venv that has llm-compressor: QUANTKIT_BENCH_LLMCOMPRESSOR_PYTHON) and
AutoRound (bench/signround_vs_autoround.py, .venv-autoround). Both are scored by bench/score.py like
quantkit's rows in `python -m bench quality`, which these rows are read beside.
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from .quality import SETUP, W4G64
from .script_suite import run_script, venv_missing

HERE = Path(__file__).resolve().parent
LLMC = "QUANTKIT_BENCH_LLMCOMPRESSOR_PYTHON"
VENV = HERE.parent / ".venv-llmc" / "bin" / "python"
ROWS = [
    # llm-compressor's default act-order ("static") is quantkit's "weight"
    {"name": "llm-compressor w4 g64 gptq", "llmc": {"actorder": "weight"}},
    # its AWQModifier with its defaults (duo scaling, 20-point grid), then its round-to-nearest or its GPTQ
    {"name": "llm-compressor w4 g64 awq", "llmc": {"algo": "awq"}},
    {"name": "llm-compressor w4 g64 awq+gptq", "llmc": {"algo": "awq+gptq"}},
    {"name": "autoround w4 g64", "script": "signround_vs_autoround.py", "needs": venv_missing(".venv-autoround/bin/python"),
     "args": ["--only", "float,autoround", "--samples", str(SETUP["samples"]), "--seq-len", str(SETUP["seq_len"]),
              "--max-windows", str(SETUP["max_windows"]), "--threads", "1"], "quick": ["--autoround-iters", "40"]},
]


def llmcompressor_rows(rows: list[dict], quick: bool, setup: dict | None = None, calib=None,
                       windows=None) -> list[dict]:
    """llm-compressor's rows on SETUP's tokens (quality.SETUP by default; CALIB and WINDOWS when the caller has
    them already), in the venv LLMC names, else .venv-llmc."""
    python = os.environ.get(LLMC) or (str(VENV) if VENV.exists() else None)
    if not python:
        return [{"name": r["name"], "skipped": f"set {LLMC} to a python with llmcompressor"} for r in rows]
    import torch

    from .quality import QUICK, tokens
    from .score import score

    import quantkit

    setup = setup or {**SETUP, **(QUICK if quick else {})}
    if calib is None:
        calib, windows = tokens(setup)
    ref = score(quantkit.load(setup["model"], exact=True, dtype=torch.float32), windows)["top1"]
    out = []
    with tempfile.TemporaryDirectory(prefix="quantkit-peers-") as tmp:
        data = Path(tmp) / "tokens.pt"
        torch.save({"calib": calib, "eval": windows, "ref_top1": ref}, data)
        for r in rows:
            res = Path(tmp) / "row.json"
            cmd = [python, str(HERE / "quality_llmcompressor.py"), "--row", json.dumps({"method": {"options": r["llmc"]}}),
                   "--scheme-fields", json.dumps(W4G64), "--model", setup["model"],
                   "--tokens", str(data), "--out", str(res), "--threads", str(setup["threads"])]
            p = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE.parent)
            out.append({"name": r["name"], **(json.loads(res.read_text()) if p.returncode == 0 else
                                              {"error": " | ".join(p.stderr.strip().splitlines()[-3:])[-300:]})})
    return out


def run(rows: list[dict], quick: bool) -> dict:
    out = llmcompressor_rows([r for r in rows if "llmc" in r], quick) if any("llmc" in r for r in rows) else []
    for r in rows:
        if "script" in r:
            out += run_script(r, quick)[0]
    return {"setup": {**SETUP, "eval": Path(SETUP["eval"]).name}, "rows": out}
