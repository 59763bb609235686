"""End-to-end batch-1 decode on a GPU: the embedded SmolLM2-135M in float16 and as a W4 checkpoint, by kernel path.

    python bench/decode_gpu.py [--tokens 64] [--prompts 4]

The W4 checkpoint is quantised here (RTN, the default plan) on the GPU. Rows: float16 weights; W4 with the
dispatcher's choice (the CUDA GEMV at 1-4 rows); W4 forced to Triton (QUANTKIT_KERNEL=triton) and to dequantise +
cuBLAS (QUANTKIT_KERNEL=torch); the same W4 on the CPU for reference. Decode tokens/s leaves the prefill out
(bench/common.py's decode_ours); "same tokens" is the share of greedy tokens equal to the float16 model's, up to the
first difference. A 135M model is launch-bound on an H200 (each step is ~200 small kernels), so this table shows the
runtime works on the device and what each path costs per step; kernel bandwidth is bench/kernels_gpu.py's table.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from gpu_timing import require_cuda  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three laws of thermodynamics are", "SELECT name FROM users WHERE", "In 1969, the first humans"]


def _quantise(src: str, out: str) -> None:
    from quantkit.job import quantize_to_checkpoint
    from quantkit.recipe import Recipe, apply_overrides

    quantize_to_checkpoint(apply_overrides(Recipe(), {"model": src, "output": out, "dtype": "float16", "quant.method": "rtn",
                                                      "device": "cuda"}))


def _same_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="batch-1 decode of SmolLM2-135M on a GPU, float16 vs W4 by kernel path")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=4)
    args = ap.parse_args(argv)
    require_cuda("bench/decode_gpu.py")
    from common import decode_ours

    import quantkit
    from quantkit.models.embedded import embedded_model_dir
    from quantkit.runtime import build
    from quantkit.runtime.sampling import SamplingParams

    src = str(embedded_model_dir())
    tok = build.load_tokenizer(src)
    prompts = [tok(p)["input_ids"] for p in PROMPTS[:args.prompts]]
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        w4 = str(Path(tmp) / "w4")
        _quantise(src, w4)
        rows = [("float16", src, torch.float16, "cuda", None), ("W4 auto", w4, None, "cuda", None),
                ("W4 triton", w4, None, "cuda", "triton"), ("W4 dequant + cuBLAS", w4, None, "cuda", "torch"),
                ("W4 on the CPU (float32)", w4, torch.float32, "cpu", None)]
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; {len(prompts)} prompts x "
              f"{args.tokens} tokens, batch 1, greedy")
        print("| model | device | decode tok/s | ms/token | same tokens as float16 |")
        print("|---|---|---|---|---|")
        base = None
        for label, path, dtype, device, forced in rows:
            os.environ.pop("QUANTKIT_KERNEL", None)
            if forced:
                os.environ["QUANTKIT_KERNEL"] = forced
            model = quantkit.load(path, device=device, dtype=dtype)
            decode_ours(model, prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True), 1, None, set())  # warm
            tps, _, _, outs = decode_ours(model, prompts, params, 1, None, set())
            base = base or outs
            same = sum(_same_prefix(a, b) for a, b in zip(outs, base)) / sum(len(b) for b in base)
            print(f"| {label} | {device} | {tps:.1f} | {1e3 / tps:.2f} | {same:.0%} |", flush=True)
            del model
            torch.cuda.empty_cache()
        os.environ.pop("QUANTKIT_KERNEL", None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
