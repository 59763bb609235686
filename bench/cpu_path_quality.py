"""What each CPU path of a W4 checkpoint costs in perplexity, against the exact model (dequantised weights, float
products: what `quantkit eval` scores).

    python bench/cpu_path_quality.py [--w4 bench/out/demo-w4] [--tokens 2048]

Every quantised Linear is forced onto one path (torch's int4 op with bf16 activations, or quantkit's W4A8 op
with int8 activations, kernels/cpu_w4a8.py) for a whole-text forward; the W4A8 op's row limit is lifted so that
the forward, which a decode would feed token by token, runs it too. Texts: bench/data/eval_prose.txt and
calibration/texts/code_calib.txt.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TEXTS = ("bench/data/eval_prose.txt", "calibration/texts/code_calib.txt")


def mean_nll(model, ids) -> float:

    with torch.inference_mode():
        logp = model(ids[None, :-1]).logits[0].float().log_softmax(-1)
    return -logp.gather(-1, ids[1:, None]).mean().item()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--w4", default=str(ROOT / "bench/out/demo-w4"))
    ap.add_argument("--tokens", type=int, default=2048)
    args = ap.parse_args(argv)
    os.environ["QUANTKIT_KERNEL_CHOICE"] = "preferred"  # each path is forced below; nothing to time
    from transformers import AutoTokenizer

    import quantkit
    from quantkit.kernels import cpu_w4a8, dispatch
    from quantkit.linear.quant import QuantLinear

    cpu_w4a8.MAX_ROWS = 1 << 30
    tok = AutoTokenizer.from_pretrained(args.w4)
    print(f"| text | exact ppl | cpu-int4pack | cpu-w4a8 |\n|---|---|---|---|")
    for text in TEXTS:
        ids = tok((ROOT / text).read_text(), return_tensors="pt").input_ids[0][: args.tokens + 1]
        row = {"exact": mean_nll(quantkit.load(args.w4, exact=True), ids)}
        for path in ("cpu-int4pack", "cpu-w4a8"):
            model = quantkit.load(args.w4)  # laid out for decoding; its fused calls follow each module's path
            for m in model.modules():
                if isinstance(m, QuantLinear):
                    dispatch.use_cpu_path(m, path)
            model._quantkit_step_plan = None
            row[path] = mean_nll(model, ids)
        ppl = {k: math.exp(v) for k, v in row.items()}
        cells = [f"{ppl[p]:.4f} ({(ppl[p] / ppl['exact'] - 1) * 100:+.2f}%)" for p in ("cpu-int4pack", "cpu-w4a8")]
        print(f"| {text} ({len(ids) - 1} tokens) | {ppl['exact']:.4f} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
