"""W8A8 INT8 quality on the embedded SmolLM2-135M: perplexity, KL to float and top-1 agreement, with and without
SmoothQuant, RTN and GPTQ weights.

    python bench/w8a8_quality.py                 # every row (about 15 minutes on 2 shared CPU cores)
    python bench/w8a8_quality.py --only smooth   # rows whose label contains the text ('|' separates several)

The calibration and evaluation text are bench/fp8_quality.py's (prose_calib.txt 10 x 256 tokens; eval_prose.txt
8 windows x 512), so the rows sit beside the FP8 and W4 rows of docs/benchmarks.md. Each quantised row goes
through the real path: quantize_model -> checkpoint -> quantkit.load (Int8Linear: int8 activations per token, or
with the static scale, and torch._int_mm). Everything runs in float32 on the CPU.
"""
from __future__ import annotations

import math
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from fp8_quality import load_texts, text_args  # noqa: E402
from quality_common import load_model  # noqa: E402

ROWS: dict[str, dict | None] = {
    "float32": None,
    "w8a8 RTN": {"scheme": "w8a8"},
    "w8a8 GPTQ": {"scheme": "w8a8", "method": "gptq"},
    "w8a8 + smooth RTN": {"scheme": "w8a8", "smooth": True},
    "w8a8 + smooth GPTQ": {"scheme": "w8a8", "smooth": True, "method": "gptq"},
    "w8a8-static + smooth GPTQ": {"scheme": "w8a8-static", "smooth": True, "method": "gptq"},
    "w8a8 + smooth 0.5 RTN (fixed alpha)": {"scheme": "w8a8", "smooth": True, "smoothquant": {"alpha": 0.5}},
}


@torch.no_grad()
def evaluate(model, windows, ref: list | None = None) -> tuple[float, float | None, float | None, list]:
    """(perplexity, mean KL(ref || model) per token, top-1 agreement with ref, log-probs when ref is None)."""
    nll, kl, agree, count, out = 0.0, 0.0, 0, 0, []
    for i, ids in enumerate(windows):
        ids = ids.reshape(1, -1)
        lp = torch.log_softmax(model(input_ids=ids).logits.float()[0, :-1], -1)
        nll -= float(lp.gather(-1, ids[0, 1:, None]).sum())
        count += lp.shape[0]
        if ref is None:
            out.append(lp)
        else:
            kl += float((ref[i].exp() * (ref[i] - lp)).sum())
            agree += int((ref[i].argmax(-1) == lp.argmax(-1)).sum())
    if ref is None:
        return math.exp(nll / count), None, None, out
    return math.exp(nll / count), kl / count, agree / count, []


def build(quant: dict, model_path: str, calib, workdir: str):
    import quantkit
    from quantkit.formats.writer import write_checkpoint
    from quantkit.pipeline import quantize_model
    from quantkit.plan import build_plan
    from quantkit.recipe import Recipe

    model = load_model(model_path)
    plan = build_plan(model, Recipe.model_validate({"quant": quant}))
    t = time.perf_counter()
    res = quantize_model(model, plan, calib)
    seconds = time.perf_counter() - t
    alphas = [s["smooth_alpha"] for s in res.stats.values() if "smooth_alpha" in s]
    out = Path(workdir) / f"row{abs(hash(str(quant)))}"
    write_checkpoint(out, model, res.qweights, plan.schemes, None, {}, res.tensors)
    return quantkit.load(out, dtype=torch.float32, exact=True), seconds, alphas


def main(argv=None) -> None:
    a = text_args(__doc__.split("\n")[0], argv)
    model_path, calib, windows = load_texts(a)
    wanted = [w.strip().lower() for w in a.only.split("|")] if a.only else []
    labels = [lb for lb in ROWS if lb == "float32" or not wanted or any(w in lb.lower() for w in wanted)]
    base, _, _, ref = evaluate(load_model(model_path), windows)
    print("| scheme / method | perplexity | vs float | KL to float (1e-3 nats/token) | top-1 agreement | "
          "smooth alpha (mean over Linears; none = not smoothed) | quantise s |")
    print("|---|---:|---:|---:|---:|---|---:|")
    print(f"| float32 | {base:.3f} | - | - | - | - | - |", flush=True)
    with tempfile.TemporaryDirectory(prefix="quantkit-w8a8-bench-") as workdir:
        for label in labels[1:]:
            model, seconds, alphas = build(ROWS[label], model_path, calib, workdir)
            ppl, kl, agree, _ = evaluate(model, windows, ref)
            chosen = [x for x in alphas if x is not None]
            alpha = "-" if not alphas else (f"{sum(chosen) / len(chosen):.2f} ({len(alphas) - len(chosen)} of "
                                            f"{len(alphas)} none)" if chosen else "all none")
            print(f"| {label} | {ppl:.3f} | {(ppl / base - 1) * 100:+.2f}% | {kl * 1e3:.2f} | {agree * 100:.1f}% | "
                  f"{alpha} | {seconds:.0f} |", flush=True)
            del model
    print(f"\ncalibration: {Path(a.calib).name}, {len(calib)} x {a.seq_len} tokens; evaluation: "
          f"{Path(a.eval).name}, {len(windows)} windows x {a.eval_seq_len} tokens")


if __name__ == "__main__":
    main()
