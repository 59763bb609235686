"""float32 products of a few rows with SmolLM2-135M's weights: MKL (nn.Linear), oneDNN's packed layout, and
float16-held weights (FBGEMM).

Usage: python bench/float_layout.py [--rows 1,2,4,5,13,32] [--threads 1]
Times one pass over 30 layers' q, k, v, o, gate, up and down projections (random weights of the real shapes, so
the 420 MB do not fit in any cache), and the 49152 x 576 output head alone, for each row count: MKL with the
weight as nn.Linear stores it ([out, in]), MKL with it stored transposed ([in, out], what the runtime used
before), linear/packed.py's PackedLinear (oneDNN, rows below 4 padded), and
linear/half_weight.py's HalfWeightLinear (the weights rounded to float16, as a float16 checkpoint's are:
half the bytes, float32 products). Best of 5 passes, in ms.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from quantkit.linear.half_weight import HalfWeightLinear, available as half_available  # noqa: E402
from quantkit.linear.packed import PackedLinear  # noqa: E402

SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]  # [out, in]
LAYERS = 30
HEAD = (49152, 576)


def best_ms(fn, reps: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def variants(weights: list[torch.Tensor]):
    """(name, list of callables x -> y), one callable per weight."""
    transposed = [w.t().contiguous() for w in weights]
    packed = [PackedLinear(w, None) for w in weights]
    out = [("MKL [out, in]", [lambda x, w=w: F.linear(x, w) for w in weights]),
           ("MKL [in, out]", [lambda x, wt=wt: x @ wt for wt in transposed]),
           ("oneDNN packed", packed)]
    if half_available():
        # random float32 weights are not float16 numbers: round them, as a float16 checkpoint's already are
        out.append(("float16 weights (FBGEMM)", [HalfWeightLinear(w, None, lossless=False) for w in weights]))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4,5,13,32")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    layers = [torch.randn(s, generator=g) for _ in range(LAYERS) for s in SHAPES]
    head = [torch.randn(HEAD, generator=g)]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); ms per pass, best of 5")
    for i, (part, weights) in enumerate((("30 layers", layers), ("head", head))):
        calls = variants(weights)
        if i == 0:
            print("| rows | part | " + " | ".join(name for name, _ in calls) + " |")
            print("|---|---|" + "---|" * len(calls))
        for rows in (int(r) for r in a.rows.split(",")):
            xs = {k: torch.randn(rows, k, generator=g) for k in {w.shape[1] for w in weights}}
            cells = []
            with torch.inference_mode():
                for _, fns in calls:
                    cells.append(best_ms(lambda fns=fns: [f(xs[w.shape[1]]) for f, w in zip(fns, weights)]))
            print(f"| {rows} | {part} | " + " | ".join(f"{c:.1f}" for c in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
