"""FP8 vs bf16 matmul time on a GPU with FP8 tensor cores (Ada/Hopper: compute capability 8.9 or newer).

    python bench/fp8_gpu.py                 # batch 1, 16, 256 x weights 4096x4096 and 8192x28672 (in x out)
    python bench/fp8_gpu.py --iters 200

Rows per shape and batch: bf16 F.linear; FP8 torch._scaled_mm alone, per tensor (one scale each side) and
row-wise (per token x per channel); and FP8Linear.forward, which adds the dynamic per-token quantisation of the
activations, i.e. what quantkit's runtime pays per call. Times are CUDA-event medians after warm-up; TFLOP/s
counts 2*M*K*N. Exits with a message (code 2) when no such GPU is present: there is no CPU fallback to time.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = [(4096, 4096), (8192, 28672)]  # (in_features K, out_features N)
BATCHES = [1, 16, 256]


def timed(fn, iters: int, warmup: int) -> float:
    """Median milliseconds per call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=20)
    a = ap.parse_args(argv)

    from quantkit import e4m3
    from quantkit.linear.fp8 import FP8Linear, fp8_matmul_supported

    if not torch.cuda.is_available():
        print("bench/fp8_gpu.py needs a CUDA GPU with FP8 tensor cores (compute capability >= 8.9, e.g. L4, "
              "4090, H100, H200); none is present, so nothing was timed.", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    if not fp8_matmul_supported(dev):
        cap = torch.cuda.get_device_capability(dev)
        print(f"{torch.cuda.get_device_name(dev)} has compute capability {cap[0]}.{cap[1]}; FP8 matmuls need 8.9 "
              "or newer, so nothing was timed.", file=sys.stderr)
        return 2

    g = torch.Generator(device=dev).manual_seed(0)
    print(f"device: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}; median of {a.iters} calls")
    print("| K x N | batch | bf16 ms | fp8 tensor ms | fp8 row-wise ms | FP8Linear ms | speed-up (tensor) | "
          "speed-up (FP8Linear) | bf16 TFLOP/s | fp8 tensor TFLOP/s | max rel diff |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for k, n in SHAPES:
        w = torch.randn(n, k, device=dev, generator=g, dtype=torch.bfloat16) * 0.02
        w_scale_t = e4m3.scale_for(w.abs().amax().reshape(1))
        w_q_t = e4m3.quantize(w, w_scale_t)
        w_scale_c = e4m3.scale_for(w.abs().amax(1, keepdim=True))
        w_q_c = e4m3.quantize(w, w_scale_c)
        lin = FP8Linear(k, n, per_channel=True, has_input_scale=False, dtype=torch.bfloat16, device=dev)
        lin.weight.copy_(w_q_c)
        lin.weight_scale.copy_(w_scale_c.to(torch.bfloat16))
        lin.use_scaled_mm = True
        for m in BATCHES:
            x = torch.randn(m, k, device=dev, generator=g, dtype=torch.bfloat16)
            x_scale_t = e4m3.scale_for(x.abs().amax().reshape(1))
            x_q_t = e4m3.quantize(x, x_scale_t)
            x_q_r, x_scale_r = e4m3.quantize_per_token(x)
            sa_t, sb_t = x_scale_t.reshape(()), w_scale_t.reshape(())
            sb_r = w_scale_c.reshape(1, -1).contiguous()

            def bf16():
                return torch.nn.functional.linear(x, w)

            def fp8_tensor():
                return torch._scaled_mm(x_q_t, w_q_t.t(), scale_a=sa_t, scale_b=sb_t, out_dtype=torch.bfloat16)

            def fp8_rowwise():
                return torch._scaled_mm(x_q_r, w_q_c.t(), scale_a=x_scale_r, scale_b=sb_r, out_dtype=torch.bfloat16)

            def fp8_linear():
                return lin(x)

            ref = bf16().float()
            diff = ((fp8_linear().float() - ref).norm() / ref.norm()).item()  # FP8 rounding, not a bug, if ~3%
            t = {name: timed(fn, a.iters, a.warmup)
                 for name, fn in [("bf16", bf16), ("tensor", fp8_tensor), ("row", fp8_rowwise), ("lin", fp8_linear)]}
            flop = 2 * m * k * n
            print(f"| {k}x{n} | {m} | {t['bf16']:.4f} | {t['tensor']:.4f} | {t['row']:.4f} | {t['lin']:.4f} | "
                  f"{t['bf16'] / t['tensor']:.2f}x | {t['bf16'] / t['lin']:.2f}x | {flop / t['bf16'] / 1e9:.1f} | "
                  f"{flop / t['tensor'] / 1e9:.1f} | {diff:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
