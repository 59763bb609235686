"""FP8 vs bf16 matmul time on a GPU with FP8 tensor cores (Ada/Hopper: compute capability 8.9 or newer).

    python bench/fp8_gpu.py                 # batch 1, 16, 256 x weights 4096x4096 and 8192x28672 (in x out)
    python bench/fp8_gpu.py --iters 200

Rows per shape and batch: bf16 F.linear; FP8 torch._scaled_mm alone, per tensor (one scale each side) and
row-wise (per token x per channel); and FP8Linear.forward, which adds the dynamic per-token quantisation of the
activations, i.e. what quantkit's runtime pays per call. Each time is per launch inside a CUDA graph of
back-to-back launches, every launch on the next of a pool of weight copies larger than twice the L2 (a 16-32 MB
weight would otherwise be read from the 50 MB L2): bench/gpu_timing.py. TFLOP/s counts 2*M*K*N. Exits with one
line (code 2) when no such GPU is present: there is no CPU fallback to time.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from gpu_timing import pool_size, require_cuda, time_us  # noqa: E402

SHAPES = [(4096, 4096), (8192, 28672)]  # (in_features K, out_features N)
BATCHES = [1, 16, 256]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--launches", type=int, default=200, help="back-to-back launches per timing (one CUDA graph)")
    a = ap.parse_args(argv)
    require_cuda("bench/fp8_gpu.py", "a CUDA GPU with FP8 tensor cores (compute capability >= 8.9)")

    from quantkit import e4m3
    from quantkit.linear.fp8 import FP8Linear, fp8_matmul_supported

    dev = torch.device("cuda")
    if not fp8_matmul_supported(dev):
        cap = torch.cuda.get_device_capability(dev)
        print(f"{torch.cuda.get_device_name(dev)} has compute capability {cap[0]}.{cap[1]}; FP8 matmuls need 8.9 "
              "or newer, so nothing was timed.", file=sys.stderr)
        return 2

    g = torch.Generator(device=dev).manual_seed(0)
    print(f"device: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}; per launch, {a.launches} "
          "launches per CUDA graph")
    print("| K x N | batch | bf16 ms | fp8 tensor ms | fp8 row-wise ms | FP8Linear ms | speed-up (tensor) | "
          "speed-up (FP8Linear) | bf16 TFLOP/s | fp8 tensor TFLOP/s | max rel diff |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for k, n in SHAPES:
        pool = pool_size(n * k)  # sized on the fp8 weight (the smallest): every kind rotates past the L2
        w, w_q_t, w_scale_t, w_q_c, w_scale_c, lins = [], [], [], [], [], []
        for _ in range(pool):
            wi = torch.randn(n, k, device=dev, generator=g, dtype=torch.bfloat16) * 0.02
            st = e4m3.scale_for(wi.abs().amax().reshape(1))
            sc = e4m3.scale_for(wi.abs().amax(1, keepdim=True))
            w.append(wi), w_scale_t.append(st), w_q_t.append(e4m3.quantize(wi, st))
            w_scale_c.append(sc), w_q_c.append(e4m3.quantize(wi, sc))
            lin = FP8Linear(k, n, per_channel=True, has_input_scale=False, dtype=torch.bfloat16, device=dev)
            lin.weight.copy_(w_q_c[-1])
            lin.weight_scale.copy_(sc.to(torch.bfloat16))
            lin.use_scaled_mm = True
            lins.append(lin)
        for m in BATCHES:
            _print_batch(m, k, n, w, w_q_t, w_scale_t, w_q_c, w_scale_c, lins, g, a.launches)
    return 0


def _print_batch(m, k, n, w, w_q_t, w_scale_t, w_q_c, w_scale_c, lins, g, launches):
    from quantkit import e4m3

    dev, pool = w[0].device, len(w)
    x = torch.randn(m, k, device=dev, generator=g, dtype=torch.bfloat16)
    x_scale_t = e4m3.scale_for(x.abs().amax().reshape(1))
    x_q_t = e4m3.quantize(x, x_scale_t)
    x_q_r, x_scale_r = e4m3.quantize_per_token(x)
    sa_t = x_scale_t.reshape(())
    sb_t = [s.reshape(()) for s in w_scale_t]
    sb_r = [s.reshape(1, -1).contiguous() for s in w_scale_c]
    calls = {
        "bf16": lambda i: torch.nn.functional.linear(x, w[i % pool]),
        "tensor": lambda i: torch._scaled_mm(x_q_t, w_q_t[i % pool].t(), scale_a=sa_t, scale_b=sb_t[i % pool],
                                             out_dtype=torch.bfloat16),
        "row": lambda i: torch._scaled_mm(x_q_r, w_q_c[i % pool].t(), scale_a=x_scale_r, scale_b=sb_r[i % pool],
                                          out_dtype=torch.bfloat16),
        "lin": lambda i: lins[i % pool](x),
    }
    ref = calls["bf16"](0).float()
    diff = ((calls["lin"](0).float() - ref).norm() / ref.norm()).item()  # FP8 rounding, not a bug, if ~3%
    t = {name: time_us(fn, pool, launches)[0] / 1e3 for name, fn in calls.items()}  # ms
    flop = 2 * m * k * n
    print(f"| {k}x{n} | {m} | {t['bf16']:.4f} | {t['tensor']:.4f} | {t['row']:.4f} | {t['lin']:.4f} | "
          f"{t['bf16'] / t['tensor']:.2f}x | {t['bf16'] / t['lin']:.2f}x | {flop / t['bf16'] / 1e9:.1f} | "
          f"{flop / t['tensor'] / 1e9:.1f} | {diff:.3f} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
