"""CPU benchmark (issue 7, requirement 4): torch's packed int4/int8 ops after our repack, and the
dequantise-into-a-buffer fallback, against a float matmul, at 1, 8 and 64 rows.

    python bench/kernels_cpu.py [--shapes 2048x2048,4096x1024] [--threads N]

Shapes are in_features x out_features. Prints a markdown table of median milliseconds per call. The packed ops
get bfloat16 activations: in torch 2.13 their fp32/fp16 paths are scalar (100-300x slower), so dispatch uses
them for bfloat16 only; the fallback is shown for fp32 activations.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from quantkit.kernels import cpu
from quantkit.testing.packed import make_packed


def _median_ms(fn, min_time=0.3, max_iters=200):
    fn()
    times, start = [], time.perf_counter()
    while len(times) < 5 or (time.perf_counter() - start < min_time and len(times) < max_iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1024x1024,2048x2048,4096x1024")
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| in x out | rows | fp32 matmul | bf16 matmul | int4 g128 packed op (bf16) | int8 channel packed op (bf16) "
          "| w4 g128 dequant+matmul (fp32) | int4 vs bf16 matmul | int8 vs bf16 matmul |")
    print("|---|---|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        k, n = map(int, shape.split("x"))
        p4 = make_packed(n, k, 4, 128, False, seed=0, scale_dtype=torch.bfloat16)
        p8 = make_packed(n, k, 8, -1, True, seed=1, scale_dtype=torch.bfloat16)
        pack4 = cpu.repack_int4(*p4.args[:5], k)
        pack8 = cpu.repack_int8(p8.weight_packed, p8.weight_scale, None, k)
        w32 = p4.w64.float()
        w16 = w32.bfloat16()
        buf = cpu.weight_buffer(n, k, torch.float32, torch.device("cpu"))
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, k)
            xb = x.bfloat16()
            t32 = _median_ms(lambda: x @ w32.t())
            t16 = _median_ms(lambda: xb @ w16.t())
            t4 = _median_ms(lambda: cpu.int4_matmul(pack4, xb))
            t8 = _median_ms(lambda: cpu.int8_matmul(pack8, xb))
            td = _median_ms(lambda: x @ cpu.dequantize_into(buf, *p4.args).t())
            print(f"| {k}x{n} | {rows} | {t32:.3f} | {t16:.3f} | {t4:.3f} | {t8:.3f} | {td:.3f} "
                  f"| {t16 / t4:.2f}x | {t16 / t8:.2f}x |")


if __name__ == "__main__":
    main()
