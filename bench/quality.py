"""Suite `quality`: perplexity and top-1 agreement of each recipe on the embedded SmolLM2-135M, with quantise time.

    python -m bench quality [--only "w4 g64"] [--quick]

Every row is a named set of recipe overrides (the dotted fields `quantkit run --set` takes) applied to the same
float model (`quantkit.load(..., exact=True)`: the checkpoint's own modules in float32), quantised in memory with
the same calibration tokens and scored by bench/score.py on the same evaluation windows (prose written for the
benchmark, bench/data/eval_prose.txt, so disjoint from any calibration source). Agreement is against the float
row, which always runs. A new solver or scheme is one more entry in ROWS.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
# SmolLM2's 576-wide projections do not divide by 128, hence group 64
W4G64 = {"quant.scheme": "w4a16", "quant.group_size": 64, "quant.symmetric": True}
W8 = {"quant.scheme": "w8a16", "quant.group_size": -1, "quant.symmetric": True}

ROWS = [
    {"name": "float", "set": {}},
    {"name": "w4 g64 rtn", "set": {**W4G64, "quant.method": "rtn"}},
    {"name": "w4 g64 gptq", "set": {**W4G64, "quant.method": "gptq"}},
    {"name": "w4 g64 awq", "set": {**W4G64, "quant.method": "awq"}},
    {"name": "w4 g64 awq+gptq", "set": {**W4G64, "quant.method": "awq+gptq"}},
    {"name": "w8 channel rtn", "set": {**W8, "quant.method": "rtn"}},
    {"name": "w8 channel gptq", "set": {**W8, "quant.method": "gptq"}},
]
# the set-up of "Beside AutoRound" in docs/benchmarks-history.md, so its W4 g64 figures are reproduced here
SETUP = {"model": "embedded", "calib": "self", "samples": 32, "seq_len": 128,
         "eval": str(HERE / "data" / "eval_prose.txt"), "eval_seq_len": 512, "max_windows": 8, "threads": 1}
QUICK = {"samples": 8, "max_windows": 2}


def tokens(setup: dict):
    """(calibration samples, evaluation windows) for a set-up; self-generated calibration samples seed 0."""
    from transformers import AutoTokenizer

    import quantkit
    from quantkit.data import load_calibration, load_eval_windows
    from quantkit.runtime.checkpoint import resolve_path

    tok = AutoTokenizer.from_pretrained(resolve_path(setup["model"]))
    model = quantkit.load(setup["model"], exact=True, dtype=torch.float32) if setup["calib"] == "self" else None
    calib = load_calibration(spec=setup["calib"], tokenizer=tok, num_samples=setup["samples"],
                             seq_len=setup["seq_len"], seed=0, model=model)
    windows = load_eval_windows(setup["eval"], tok, seq_len=setup["eval_seq_len"], max_windows=setup["max_windows"])
    return list(calib.samples), list(windows)


def measure(model_path: str, rows: list[dict], calib, windows) -> list[dict]:
    """Quantise a fresh float copy per row with its overrides and score it; the first row is the reference."""
    import quantkit
    from quantkit.pipeline import quantize_model
    from quantkit.plan import build_plan
    from quantkit.recipe import Recipe, apply_overrides

    from .score import score

    out, ref = [], None
    for row in rows:
        model = quantkit.load(model_path, exact=True, dtype=torch.float32)
        res = {"name": row["name"]}
        if row["set"]:
            t, c = time.perf_counter(), time.process_time()
            result = quantize_model(model, build_plan(model, apply_overrides(Recipe(), row["set"])), calib)
            res["quantise_wall_s"], res["quantise_cpu_s"] = time.perf_counter() - t, time.process_time() - c
            # the solvers' own time (each Linear's solve, guards included); the rest is feeding them
            res["solve_wall_s"] = sum(s.get("seconds", 0.0) for s in result.stats.values())
        s = score(model, windows, ref)
        ref = s["top1"] if ref is None else ref
        res.update(ppl=s["ppl"], agreement=s["agreement"])
        print(f"{row['name']}: {res}", file=sys.stderr, flush=True)
        out.append(res)
    return out


def prepare(setup: dict, rows: list[dict]):
    """(rows with the float row first, calibration samples, evaluation windows) for SETUP, its threads set:
    agreement is counted against the float model's tokens."""
    torch.set_num_threads(setup["threads"])
    if rows[0]["name"] != ROWS[0]["name"]:
        rows = [ROWS[0], *rows]
    return (rows, *tokens(setup))


def run(rows: list[dict], quick: bool) -> dict:
    setup = {**SETUP, **(QUICK if quick else {})}
    rows, calib, windows = prepare(setup, rows)
    setup.update(eval=Path(setup["eval"]).name, windows=len(windows))
    return {"setup": setup, "rows": measure(setup["model"], rows, calib, windows)}
