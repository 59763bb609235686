"""Learned rounding (--method signround) beside the `auto-round` package on the embedded SmolLM2-135M, W4 g64 sym.

    python bench/signround_vs_autoround.py                         # every row
    python bench/signround_vs_autoround.py --only float,rtn,gptq,signround
    python bench/signround_vs_autoround.py --only autoround --autoround-iters 40

Every row uses the same calibration tokens (bench/out/signround/calib_tokens.pt, read by both libraries; the first run
makes them from --calib: 32 x 256 tokens sampled from the model itself, or cut from a local text file, seed 0) and the same evaluation windows
(bench/data/eval_prose.txt, 16 x 512 tokens) scored by bench/score.py (quantkit's perplexity). quantkit rows are quantised
in memory (their checkpoints compute the same logits: tests/test_signround.py); the AutoRound row runs
bench/signround_autoround_worker.py in AutoRound's own venv (.venv-autoround: `python3 -m venv .venv-autoround
&& .venv-autoround/bin/pip install torch==2.13.0 auto-round`) and its checkpoint is loaded here through
transformers. Rows are kept in bench/out/signround/rows.json so they can be run separately; the table is printed
from every row stored. "gap closed" is (RTN - method) / (RTN - float) in perplexity.
"""
from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from quality_common import load_model, perplexity  # noqa: E402

OUT = HERE / "out" / "signround"
W4G64 = {"quant.scheme": "w4a16", "quant.group_size": 64, "quant.symmetric": True}
METHODS = {"rtn": {"quant.method": "rtn"},
           "gptq": {"quant.method": "gptq", "quant.gptq.actorder": "weight"},
           "awq": {"quant.method": "awq"},
           "awq+gptq": {"quant.method": "awq+gptq", "quant.gptq.actorder": "weight"},
           "signround": {"quant.method": "signround"}}


def calib_tokens(out: Path, model_path: str, spec: str, samples: int, seq_len: int):
    """The stored calibration tokens, made on the first run from SPEC ('self': sampled from the model, else a
    calibration spec such as a local text file), seed 0."""
    import torch

    path = out / "calib_tokens.pt"
    if not path.exists():
        from transformers import AutoTokenizer

        from quantkit.data import load_calibration

        tok = AutoTokenizer.from_pretrained(model_path)
        model = load_model(model_path) if spec == "self" else None
        c = load_calibration(spec=spec, tokenizer=tok, num_samples=samples, seq_len=seq_len, seed=0, model=model)
        out.mkdir(parents=True, exist_ok=True)
        torch.save(torch.stack([s.reshape(-1) for s in c.samples]), path)
    return path, torch.load(path)


def quantkit_row(name: str, base, ids, overrides: dict) -> tuple:
    from quantkit.pipeline import quantize_model
    from quantkit.plan import build_plan
    from quantkit.recipe import Recipe, apply_overrides

    model = copy.deepcopy(base)
    recipe = apply_overrides(Recipe(), {**W4G64, **METHODS[name], **overrides})
    t, c = time.perf_counter(), time.process_time()
    res = quantize_model(model, build_plan(model, recipe), [row.unsqueeze(0) for row in ids])
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    falls = sum(1 for s in res.stats.values() if s.get("signround_fallback"))
    return model, {"quantise_wall_s": wall, "quantise_cpu_s": cpu, "fallback_linears": falls}


def autoround_row(a, model_path: str, tokens: Path) -> tuple:
    out = Path(a.out) / f"autoround-{a.autoround_iters}x{a.autoround_batch}"
    cmd = [a.autoround_python, str(HERE / "signround_autoround_worker.py"), model_path, str(tokens), str(out),
           "--iters", str(a.autoround_iters), "--batch", str(a.autoround_batch), "--threads", str(a.threads)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"AutoRound worker failed:\n{p.stderr[-3000:]}")
    info = json.loads(p.stdout.strip().splitlines()[-1])
    import torch
    from transformers import AutoModelForCausalLM

    # AutoRound's own export format, which transformers reads (quantkit.load opens compressed-tensors)
    return AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval(), info


def table(rows: dict) -> str:
    fl, rtn = rows.get("float", {}).get("ppl"), rows.get("rtn", {}).get("ppl")
    lines = ["| method (W4 g64 sym) | perplexity | gap closed | quantise wall s | quantise CPU s | note |",
             "|---|---:|---:|---:|---:|---|"]
    for name, r in rows.items():
        gap = "-" if None in (fl, rtn) or name in ("float", "rtn") else f"{(rtn - r['ppl']) / (rtn - fl):.0%}"
        w, c = r.get("quantise_wall_s"), r.get("quantise_cpu_s")
        lines.append(f"| {name} | {r['ppl']:.3f} | {gap} | {'-' if w is None else f'{w:.0f}'} | "
                     f"{'-' if c is None else f'{c:.0f}'} | {r.get('note', '')} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="float,rtn,gptq,signround,autoround")
    ap.add_argument("--calib", default="self", help="calibration spec for a first run ('self' or a local file)")
    ap.add_argument("--out", default=str(OUT), help="folder of the stored tokens, rows and AutoRound checkpoints "
                    "(one per calibration set: its rows are only comparable with each other)")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--iters", type=int, default=None, help="our signround iterations (default: the recipe's)")
    ap.add_argument("--autoround-iters", type=int, default=200)
    ap.add_argument("--autoround-batch", type=int, default=8, help="samples per AutoRound step (its default 8)")
    ap.add_argument("--autoround-python", default=str(HERE.parent / ".venv-autoround" / "bin" / "python"))
    ap.add_argument("--eval", default=str(HERE / "data" / "eval_prose.txt"))
    ap.add_argument("--max-windows", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--set", action="append", default=[], help="recipe override FIELD=VALUE for quantkit rows")
    ap.add_argument("--tag", default="", help="suffix of the stored row names, to keep variants apart")
    a = ap.parse_args(argv)
    out = Path(a.out)
    import torch
    from transformers import AutoTokenizer

    from quantkit.cli.set_option import parse_set
    from quantkit.data import load_eval_windows
    from quantkit.models.embedded import embedded_model_dir

    torch.set_num_threads(a.threads)
    path = str(embedded_model_dir())
    tokens, ids = calib_tokens(out, path, a.calib, a.samples, a.seq_len)
    windows = load_eval_windows(a.eval, AutoTokenizer.from_pretrained(path), seq_len=512, max_windows=a.max_windows)
    store = out / "rows.json"
    rows: dict = {}
    base = load_model(path)
    for name in a.only.split(","):
        if name == "float":
            model, info = base, {}
        elif name == "autoround":
            model, info = autoround_row(a, path, tokens)
            info["note"] = f"auto-round, {a.autoround_iters} iters, batch {a.autoround_batch}, {info['format']} export"
        else:
            extra = {"quant.signround.iters": a.iters} if name == "signround" and a.iters else {}
            extra.update(parse_set(a.set))
            model, info = quantkit_row(name, base, ids, extra)
            info["note"] = f"quantkit; {info.pop('fallback_linears')} Linears fell back" if name == "signround" else "quantkit"
        row = {"ppl": perplexity(model, list(windows)), **info}
        rows = json.loads(store.read_text()) if store.exists() else {}  # another run may have added rows
        rows[name + a.tag] = row
        store.write_text(json.dumps(rows, indent=1))
        print(f"{name + a.tag}: {row}", file=sys.stderr, flush=True)
    print(table(rows))
    # the stored file may hold any text (self-generated when this script wrote it; docs say what was used)
    print(f"\ncalibration {len(ids)} x {ids.shape[1]} tokens from {tokens}; eval {Path(a.eval).name}, "
          f"{len(windows)} x 512 tokens; torch threads {a.threads}")


if __name__ == "__main__":
    main()
