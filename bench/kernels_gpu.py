"""GPU W4A16 kernel benchmark: quantkit's kernels against cuBLAS fp16 and bf16 and torch's own int4 kernel.

    python bench/kernels_gpu.py [--quick] [--launches 200]

1. Checks each quantkit kernel against the float32 reference on small random data; a failing kernel is reported
   and left out of the timings, never timed as if correct.
2. Measures the device copy bandwidth (1 GiB device-to-device, read + write): the bandwidth each row is held to.
3. For in x out 4096x4096, 4096x14336, 14336x4096, 8192x28672 and rows 1, 2, 4, 16, 64, 256 (W4, group 128,
   symmetric): cuBLAS fp16, torch's bf16 matmul, torch._weight_int4pack_mm (bf16, its own layout), the Triton fused matmul, the CUDA
   GEMV (rows <= 4), the CUDA tensor-core GEMM (rows <= 64) and Triton dequantise + cuBLAS. Each is timed inside a CUDA graph of back-to-back launches
   (bench/gpu_timing.py), every launch on the next of a pool of weight copies larger than twice the L2.
Prints a markdown table (us per call, GB/s of bytes that must move, fraction of copy bandwidth, speed-up over
cuBLAS fp16) and, per shape, the row counts where each quantkit kernel stops winning: the dispatch thresholds
(kernels/dispatch.py) should be set from these. A Marlin kernel is not timed: no package for it installs here.
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from gpu_timing import copy_bandwidth_gbs, pool_size, require_cuda, rotating, time_us  # noqa: E402

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672)]
ROWS = [1, 2, 4, 16, 64, 256]
GROUP = 128


def random_packed(n, k, bits, group_size, symmetric, gen):
    """Random codes packed as the checkpoint stores them, with fp16 scales (and int32 zero points)."""
    from quantkit.formats.pack import pack_int32

    qmax = (1 << (bits - 1)) - 1
    q = torch.randint(-qmax - 1, qmax + 1, (n, k), device="cuda", generator=gen, dtype=torch.int16)
    groups = 1 if group_size == -1 else k // group_size
    scale = (torch.rand(n, groups, device="cuda", generator=gen) * 0.02 + 0.001).half()
    zp = None
    if not symmetric:
        zp = pack_int32(torch.randint(-qmax - 1, qmax + 1, (n, groups), device="cuda", generator=gen), bits, dim=0)
    return pack_int32(q, bits), scale, zp


def quantkit_kernels() -> dict:
    """name -> f(x, wp, scale, zp, g_idx, group_size, bits) or None where the kernel does not cover the case."""
    kernels = {}
    try:
        from quantkit.kernels.triton import wna16_matmul

        kernels["triton fused"] = lambda x, wp, sc, zp, gi, gs, bits: wna16_matmul(x, wp, sc, zp, gi, gs, bits)
    except Exception as e:  # noqa: BLE001
        print(f"triton unavailable: {e}")
    try:
        t0 = time.time()
        from quantkit.kernels import cuda as qc

        qc.load()
        print(f"CUDA ops built/loaded in {time.time() - t0:.0f} s")

        def cuda_gemv(x, wp, sc, zp, gi, gs, bits):
            if not qc.gemv_supported(x.shape[-1], gs, gi is not None, bits, x.shape[0], x.dtype):
                return None
            return qc.gemv_w4a16(x, wp, sc.to(x.dtype), zp, gi, gs)

        kernels["cuda gemv"] = cuda_gemv

        def cuda_tc(x, wp, sc, zp, gi, gs, bits):
            if not qc.tc_supported(x.shape[-1], gs, gi is not None, bits, x.shape[0], x.dtype):
                return None
            return qc.gemm_w4a16_tc(x, wp, sc.to(x.dtype), zp, gs)

        kernels["cuda tensor cores"] = cuda_tc
    except Exception as e:  # noqa: BLE001
        print(f"CUDA kernels unavailable: {e}")
    return kernels


def correctness(kernels: dict) -> dict:
    from quantkit.kernels import reference

    gen = torch.Generator(device="cuda").manual_seed(0)
    status = {}
    cases = [(4, 128, True, None), (4, 128, False, None), (4, 64, False, "actorder"), (4, -1, True, None),
             (4, 48, False, None), (8, 128, False, None)]
    n, k = 384, 1152
    for name, fn in kernels.items():
        try:
            for bits, gs, sym, gflag in cases:
                wp, sc, zp = random_packed(n, k, bits, gs, sym, gen)
                gi = (torch.randperm(k, device="cuda", generator=gen) // gs).to(torch.int32) if gflag else None
                for rows in (1, 3, 4, 17):
                    for dtype in (torch.float16, torch.bfloat16):
                        x = torch.randn(rows, k, device="cuda", generator=gen).to(dtype)
                        y = fn(x, wp, sc, zp, gi, gs, bits)
                        if y is None:
                            continue
                        ref = reference.matmul(x, wp, sc, zp, gi, gs, bits, k)
                        err = (y.float() - ref).abs().max().item() / ref.abs().max().item()
                        tol = 1.5e-2 if dtype == torch.bfloat16 else 3e-3  # output rounding + 16-bit weights
                        if not err <= tol:
                            raise AssertionError(f"bits={bits} g={gs} sym={sym} g_idx={gflag} rows={rows} "
                                                 f"{dtype}: rel err {err:.3g} > {tol}")
            status[name] = "ok"
        except Exception as e:  # noqa: BLE001
            status[name] = f"FAILED: {e}"
            traceback.print_exc()
    return status


def torch_int4(n, k, gen):
    """torch's own int4 kernel on random codes in its layout: (packed, scales_and_zeros), or the reason not."""
    try:
        codes = torch.randint(0, 256, (n, k // 2), device="cuda", generator=gen, dtype=torch.uint8)
        packed = torch._convert_weight_to_int4pack(codes, 8)
        sz = (torch.rand(k // GROUP, n, 2, device="cuda", generator=gen) * 0.01).to(torch.bfloat16)
        torch._weight_int4pack_mm(torch.randn(1, k, device="cuda", dtype=torch.bfloat16), packed, GROUP, sz)
        return packed, sz
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"


def shape_rows(k, n, kernels, bw, launches, gen):
    """Timed rows for one weight shape: [(rows, name, us, bytes, mode)]."""
    from quantkit.kernels.triton import dequantize_int

    w16 = torch.randn(n, k, device="cuda", dtype=torch.float16, generator=gen)
    wp, sc, _ = random_packed(n, k, 4, GROUP, True, gen)
    p16, p4 = pool_size(w16.nbytes), pool_size(wp.nbytes + sc.nbytes)
    w16s, packs = rotating([w16], p16), rotating([wp, sc], p4)
    wbs = rotating([w16.bfloat16()], p16)
    del w16
    int4 = torch_int4(n, k, gen)
    int4s = rotating(list(int4), pool_size(int4[0].nbytes)) if isinstance(int4, tuple) else None
    if not isinstance(int4, tuple):
        print(f"torch int4 unavailable on {k}x{n}: {int4}")
    buf = torch.empty(n, k, device="cuda", dtype=torch.float16)
    out = []
    for rows in ROWS:
        xs = [torch.randn(rows, k, device="cuda", dtype=torch.float16, generator=gen) for _ in range(4)]
        xb = [x.bfloat16() for x in xs]
        io = 2 * rows * (k + n)
        q_bytes = wp.nbytes + sc.nbytes + io
        calls = [("cuBLAS fp16", lambda i: xs[i % 4] @ w16s[i % p16][0].t(), p16, n * k * 2 + io),
                 ("torch bf16 matmul", lambda i: xb[i % 4] @ wbs[i % p16][0].t(), p16, n * k * 2 + io)]
        if int4s:
            calls.append(("torch int4 (bf16)", lambda i: torch._weight_int4pack_mm(
                xb[i % 4], int4s[i % len(int4s)][0], GROUP, int4s[i % len(int4s)][1]), len(int4s), q_bytes))
        if "triton fused" in kernels:
            calls.append(("triton fused", lambda i: kernels["triton fused"](xs[i % 4], *packs[i % p4], None, None,
                                                                             GROUP, 4), p4, q_bytes))
        if "cuda gemv" in kernels and rows <= 4:
            from quantkit.kernels.cuda import gemv_w4a16

            calls.append(("cuda gemv", lambda i: gemv_w4a16(xs[i % 4], *packs[i % p4], None, None, GROUP), p4, q_bytes))
        if "cuda tensor cores" in kernels and rows <= 64:
            from quantkit.kernels.cuda import gemm_w4a16_tc

            calls.append(("cuda tensor cores", lambda i: gemm_w4a16_tc(xs[i % 4], *packs[i % p4], None, GROUP), p4,
                          q_bytes))
        if "triton fused" in kernels:
            def deq_mm(i):
                dequantize_int(*packs[i % p4], None, None, GROUP, 4, k, out=buf)
                return xs[i % 4] @ buf.t()

            calls.append(("triton dequant + cuBLAS", deq_mm, p4, q_bytes))
        for name, call, copies, nbytes in calls:
            us, mode = time_us(call, copies, launches)
            out.append((rows, name, us, nbytes, mode))
    return out


def print_shape(k, n, rows_out, bw):
    base = {r: us for r, name, us, _, _ in rows_out if name == "cuBLAS fp16"}
    for rows, name, us, nbytes, mode in rows_out:
        gbs = nbytes / (us * 1e-6) / 1e9
        print(f"| {k}x{n} | {rows} | {name} | {us:.1f} | {gbs:.0f} | {gbs / bw:.0%} | {base[rows] / us:.2f}x | "
              f"{mode} |", flush=True)
    best = {}
    for rows, name, us, _, _ in rows_out:
        best.setdefault(rows, {})[name] = us
    for kernel, rival in (("triton fused", "triton dequant + cuBLAS"), ("cuda gemv", "triton fused"),
                          ("cuda tensor cores", "triton fused")):
        wins = [r for r, t in best.items() if kernel in t and rival in t and t[kernel] < t[rival]]
        print(f"<!-- {k}x{n}: {kernel} beats {rival} at rows {wins or 'none'} -->")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="W4A16 GPU kernels vs cuBLAS fp16 and torch int4 (needs CUDA)")
    ap.add_argument("--quick", action="store_true", help="the first two shapes only")
    ap.add_argument("--launches", type=int, default=200, help="back-to-back launches per timing (one CUDA graph)")
    args = ap.parse_args(argv)
    require_cuda("bench/kernels_gpu.py", "a CUDA GPU (bench/kernels_cpu.py times the CPU paths)")
    t_start = time.time()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    kernels = quantkit_kernels()
    status = correctness(kernels)
    print("\n## correctness against reference")
    for name, s in status.items():
        print(f"- {name}: {s}")
    kernels = {k: v for k, v in kernels.items() if status.get(k) == "ok"}
    bw = copy_bandwidth_gbs()
    print(f"\ncopy bandwidth: {bw:.0f} GB/s (1 GiB device-to-device, read + write)\n")
    print("| in x out | rows | kernel | us | GB/s | of copy BW | vs cuBLAS fp16 | timing |")
    print("|---|---|---|---|---|---|---|---|")
    gen = torch.Generator(device="cuda").manual_seed(2)
    for k, n in SHAPES[:2] if args.quick else SHAPES:
        print_shape(k, n, shape_rows(k, n, kernels, bw, args.launches, gen), bw)
        torch.cuda.empty_cache()
    print(f"\ntotal {time.time() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
