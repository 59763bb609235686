"""AWQ quality on the embedded SmolLM2-135M, W4 g64: perplexity of RTN, AWQ, AWQ+GPTQ (and GPTQ) vs float.

    python bench/awq_quality.py                           # float, RTN, AWQ, AWQ+GPTQ
    python bench/awq_quality.py --methods rtn,awq --search-tokens 1024,4096
    python bench/awq_quality.py --calib calibration/texts/prose_calib.txt

The same inputs as bench/quality.py (calibration: 32 samples x 256 tokens, by default sampled from the model
itself; evaluation: bench/data/eval_prose.txt in 16 windows of 512 tokens) and the same scoring code
(quality_common.py), so the rows can be merged into that table. Rows run one after another in this process on
copies of the float32 model. --search-tokens sets AWQ's alpha-search token budget (recipe quant.awq.search_tokens), which is the main cost of AWQ on a CPU.
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from quality_common import load_model, perplexity  # noqa: E402

W4G64 = {"quant.scheme": "w4a16", "quant.group_size": 64, "quant.symmetric": True}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--methods", default="rtn,awq,awq+gptq", help="comma list of rtn, gptq, awq, awq+gptq")
    ap.add_argument("--search-tokens", default=None, help="comma list of AWQ search budgets (default: the solver's)")
    ap.add_argument("--duo", action="store_true", help="also run AWQ rows with the duo scale form")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--calib", default="self")
    ap.add_argument("--eval", default=str(HERE / "data" / "eval_prose.txt"))
    ap.add_argument("--eval-seq-len", type=int, default=512)
    ap.add_argument("--max-windows", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    a = ap.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    import quantkit.solvers.awq as awq
    from quantkit.data import load_calibration, load_eval_windows
    from quantkit.models.embedded import embedded_model_dir
    from quantkit.pipeline import quantize_model
    from quantkit.plan import build_plan
    from quantkit.recipe import Recipe, apply_overrides

    if a.threads:
        torch.set_num_threads(a.threads)
    path = str(embedded_model_dir())
    tok = AutoTokenizer.from_pretrained(path)
    base = load_model(path)
    t = time.perf_counter()
    calib = load_calibration(spec=a.calib, tokenizer=tok, num_samples=a.samples, seq_len=a.seq_len, seed=0,
                             model=base if a.calib == "self" else None)
    calib_s = time.perf_counter() - t
    windows = load_eval_windows(a.eval, tok, seq_len=a.eval_seq_len, max_windows=a.max_windows)
    budgets = [int(b) for b in a.search_tokens.split(",")] if a.search_tokens else [awq.SEARCH_TOKENS]

    rows = [("float32", None, None, None)]
    for m in a.methods.split(","):
        if m.startswith("awq"):
            for b in budgets:
                for duo in ([False, True] if a.duo else [False]):
                    rows.append((f"{m.upper()}{' duo' if duo else ''} (search {b} tok)", m, b, duo))
        else:
            rows.append((m.upper(), m, None, None))

    lines = ["| method (W4 g64) | perplexity | vs float | quantise s | mean alpha | mean clip |",
             "|---|---:|---:|---:|---:|---:|"]
    float_ppl = None
    for label, method, budget, duo in rows:
        model = copy.deepcopy(base)
        secs = alpha = clip = None
        if method:
            recipe = apply_overrides(Recipe(), {**W4G64, "quant.method": method, "quant.awq.duo": duo,
                                                "quant.awq.search_tokens": budget})
            t = time.perf_counter()
            res = quantize_model(model, build_plan(model, recipe), calib.samples)
            secs = time.perf_counter() - t
            alphas = [s["awq_alpha"] for s in res.stats.values() if s.get("awq_alpha") is not None]
            clips = [s["awq_clip_mean"] for s in res.stats.values() if s.get("awq_clip_mean") is not None]
            alpha = sum(alphas) / len(alphas) if alphas else None
            clip = sum(clips) / len(clips) if clips else None
        ppl = perplexity(model, list(windows))
        float_ppl = float_ppl or ppl
        vs = "-" if method is None else f"{(ppl / float_ppl - 1) * 100:+.1f}%"
        f = (lambda v, s: "-" if v is None else format(v, s))
        lines.append(f"| {label} | {ppl:.3f} | {vs} | {f(secs, '.0f')} | {f(alpha, '.3f')} | {f(clip, '.3f')} |")
        print(lines[-1], file=sys.stderr, flush=True)
        del model
    lines.append("")
    lines.append(f"calibration: {a.calib}, {len(calib)} x {a.seq_len} tokens ({calib_s:.0f} s to make); "
                 f"evaluation: {Path(a.eval).name}, {len(windows)} windows x {a.eval_seq_len} tokens; "
                 f"torch threads {torch.get_num_threads()}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
