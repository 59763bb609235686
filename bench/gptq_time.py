"""Suite `gptq_time` (issue 41, requirement 5): quantkit's GPTQ against llm-compressor's GPTQ in time, on the
same SmolLM2-135M, the same 32 x 256 self-sampled calibration tokens and the same two threads, each scored by
bench/score.py on the same held-out prose. quantkit's rows give the solvers' share of the time (`solve_wall_s`,
each Linear's solve with its guard); the rest is feeding them: the layer passes and the Hessian sums.

    python -m bench gptq_time [--quick]
"""
from __future__ import annotations

from pathlib import Path

from .peers import llmcompressor_rows
from .quality import SETUP as QUALITY_SETUP
from .quality import W4G64, measure, prepare

GPTQ = {**W4G64, "quant.method": "gptq"}
ROWS = [
    {"name": "float", "set": {}},
    {"name": "quantkit gptq (default: act-order weight, held-out guard)", "set": GPTQ},
    {"name": "quantkit gptq, no guard", "set": {**GPTQ, "calibration.holdout": 0}},
    # llm-compressor's default act-order ("static") is quantkit's "weight"
    {"name": "llm-compressor 0.14 gptq (act-order static)", "llmc": {"actorder": "weight"}},
]
SETUP = {**QUALITY_SETUP, "samples": 32, "seq_len": 256, "threads": 2}
QUICK = {"samples": 8, "max_windows": 2}


def run(rows: list[dict], quick: bool) -> dict:
    setup = {**SETUP, **(QUICK if quick else {})}
    rows, calib, windows = prepare(setup, rows)
    out = measure(setup["model"], [r for r in rows if "set" in r], calib, windows)
    peers = [r for r in rows if "llmc" in r]
    if peers:
        out += llmcompressor_rows(peers, quick, setup, calib, windows)
    for r in out:  # llm-compressor's worker names its times its own way: one set of columns for the table
        if "quant_seconds" in r:
            r["quantise_wall_s"], r["quantise_cpu_s"] = r.pop("quant_seconds"), r.pop("quant_cpu_seconds")
        r.pop("peak_reset", None)
    names = {r["name"] for r in peers}
    ref = next((r["quantise_cpu_s"] for r in out if r["name"] in names and "quantise_cpu_s" in r), None)
    for r in out:
        if ref and r.get("quantise_cpu_s"):
            r["cpu_vs_llm_compressor"] = r["quantise_cpu_s"] / ref
    setup.update(eval=Path(setup["eval"]).name, windows=len(windows))
    return {"setup": setup, "rows": out,
            "note": "Goal (issue 41, requirement 5): quantkit's default GPTQ at most 0.5x llm-compressor's CPU time. "
                    "Where the time goes, and why the goal is not met: benchmarks-history.md, \"GPTQ's time beside "
                    "llm-compressor's\"."}
