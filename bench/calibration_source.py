"""How the calibration source changes W4 (group 64) perplexity of the embedded SmolLM2-135M.

    python bench/calibration_source.py                       # RTN, and GPTQ when quantkit.solvers.gptq exists
    python bench/calibration_source.py --num-samples 10 --seq-len 256 --extra wikitext2

Sources: text sampled from the model itself ('self', the default), a local prose file in the same domain as
the evaluation text (calibration/texts/prose_calib.txt), and a mismatched domain (Python code,
calibration/texts/code_calib.txt). Perplexity is measured on calibration/texts/prose_eval.txt, written
separately from the calibration prose; the script checks that no 16-token run of the evaluation windows
appears in any calibration set. RTN ignores calibration, so it is one row: the bar GPTQ has to clear.
The calibration files are a few thousand tokens each, so the default request (10 x 256) fits all three.
"""
from __future__ import annotations

import argparse
import copy
from pathlib import Path
import sys
import time

import torch

from quantkit.shipped import shipped_dir

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quality_common import perplexity  # noqa: E402

TEXTS = shipped_dir("calibration") / "texts"
SOURCES = {"self": "self", "local prose": str(TEXTS / "prose_calib.txt"), "code (mismatched)":
           str(TEXTS / "code_calib.txt")}


def ngrams(samples: list[torch.Tensor], n: int) -> set[tuple]:
    out = set()
    for s in samples:
        t = s.tolist()
        out.update(tuple(t[i:i + n]) for i in range(len(t) - n + 1))
    return out


def gptq_available() -> bool:
    try:
        from quantkit.solvers import gptq  # noqa: F401
    except ImportError:
        return False
    return True


def quantize(model, method: str, samples):
    from quantkit.pipeline import quantize_model
    from quantkit.plan import build_plan
    from quantkit.recipe import Recipe

    # SmolLM2's 576-wide projections do not divide by 128, hence group 64.
    recipe = Recipe.model_validate({"quant": {"scheme": "w4a16", "method": method, "group_size": 64,
                                              "symmetric": True}})
    t = time.time()
    quantize_model(model, build_plan(model, recipe), samples)
    return time.time() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-samples", type=int, default=10)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--eval-seq-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--extra", nargs="*", default=[], help="more specs to compare (a named set if cached, a file)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantkit.data import load_calibration, load_eval_windows
    from quantkit.errors import UserError
    from quantkit.models.embedded import embedded_model_dir

    path = embedded_model_dir()
    tok = AutoTokenizer.from_pretrained(path)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    windows = load_eval_windows(str(TEXTS / "prose_eval.txt"), tok, seq_len=args.eval_seq_len)
    eval_grams = ngrams(list(windows), 16)

    rows = []
    ppl_float = perplexity(base, windows)
    rows.append(("float32", "-", "-", f"{ppl_float:.3f}", "-", "-"))
    model = copy.deepcopy(base)
    secs = quantize(model, "rtn", None)
    ppl = perplexity(model, windows)
    rows.append(("RTN", "(none)", "-", f"{ppl:.3f}", f"{ppl - ppl_float:+.3f}", f"{secs:.1f}"))
    del model

    have_gptq = gptq_available()
    sources = dict(SOURCES, **{s: s for s in args.extra})
    for label, spec in sources.items():
        t = time.time()
        try:
            calib = load_calibration(spec, tok, num_samples=args.num_samples, seq_len=args.seq_len, seed=args.seed,
                                     model=base)
        except UserError as e:
            print(f"skipped {label}: {e}", file=sys.stderr)
            continue
        load_s = time.time() - t
        overlap = len(eval_grams & ngrams(calib.samples, 16))
        if overlap:
            print(f"warning: {label} shares {overlap} 16-token runs with the evaluation text", file=sys.stderr)
        if not have_gptq:
            rows.append(("GPTQ", label, str(calib.num_tokens), "n/a: quantkit.solvers.gptq missing", "-", "-"))
            continue
        model = copy.deepcopy(base)
        secs = quantize(model, "gptq", calib.samples)
        ppl = perplexity(model, windows)
        rows.append(("GPTQ", label, str(calib.num_tokens), f"{ppl:.3f}", f"{ppl - ppl_float:+.3f}",
                     f"{load_s:.1f} + {secs:.1f}"))
        del model

    print(f"\nSmolLM2-135M-Instruct, W4 g64 symmetric, calibration {args.num_samples} x {args.seq_len} tokens "
          f"(seed {args.seed}); perplexity on prose_eval.txt, {len(windows)} windows of {args.eval_seq_len} "
          f"tokens; torch threads {torch.get_num_threads()}\n")
    head = ("method", "calibration", "calib tokens", "perplexity", "vs float", "seconds (calib + quantise)")
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
