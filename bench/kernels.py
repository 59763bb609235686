"""GPU kernel benchmark (issue 7, requirement 6): one script, sized for an H200 in under 10 minutes.

    python bench/kernels.py [--quick]

1. Checks every kernel against the float32 reference on small random data (a failing kernel is reported and
   left out of the timings, never timed as if correct).
2. Measures device copy bandwidth (device-to-device copy of 1 GiB, counted as read + write).
3. For in x out shapes 4096x4096, 4096x14336, 14336x4096, 8192x28672 and rows 1, 4, 16, 64, 256 (W4 g128
   symmetric, fp16): fp16 matmul, Triton fused matmul, CUDA GEMV (rows <= 4), Triton dequant + cuBLAS. Median of
   many runs timed with CUDA events; inputs and weights rotate through enough copies to defeat the 50 MB L2.
Prints a markdown table: microseconds, GB/s of bytes that must move (weights, scales, x, y), fraction of the
measured copy bandwidth, and speedup over fp16. Paste it into docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback

import torch

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672)]
ROWS = [1, 4, 16, 64, 256]
L2_DEFEAT_BYTES = 256 << 20


def _events_median_us(fn, iters: int) -> float:
    for _ in range(3):
        fn(0)
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        starts[i].record()
        fn(i)
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3


def copy_bandwidth() -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    us = _events_median_us(lambda i: b.copy_(a), 20)
    return 2 * a.numel() / (us * 1e-6) / 1e9


def _random_packed(n, k, bits, group_size, symmetric, device, gen):
    """Random codes packed as the checkpoint stores them (packing on GPU: much faster than RTN on CPU)."""
    from quantkit.formats.pack import pack_int32

    qmax = (1 << (bits - 1)) - 1
    q = torch.randint(-qmax - 1, qmax + 1, (n, k), device=device, generator=gen, dtype=torch.int16)
    groups = 1 if group_size == -1 else k // group_size
    scale = (torch.rand(n, groups, device=device, generator=gen) * 0.02 + 0.001).half()
    zp = None
    if not symmetric:
        zp = pack_int32(torch.randint(-qmax - 1, qmax + 1, (n, groups), device=device, generator=gen), bits, dim=0)
    return pack_int32(q, bits), scale, zp


def correctness(kernels: dict) -> dict:
    """Each kernel against reference.matmul / reference.dequantize; returns name -> 'ok' or the failure."""
    from quantkit.kernels import reference

    gen = torch.Generator(device="cuda").manual_seed(0)
    status = {}
    cases = [(4, 128, True, None), (4, 128, False, None), (4, 64, False, "actorder"), (4, -1, True, None),
             (8, 128, False, None), (8, -1, True, None)]
    n, k = 384, 1024
    for name, fn in kernels.items():
        try:
            for bits, gs, sym, gflag in cases:
                wp, sc, zp = _random_packed(n, k, bits, gs, sym, "cuda", gen)
                gi = None
                if gflag:
                    gi = (torch.randperm(k, device="cuda", generator=gen) // gs).to(torch.int32)
                for rows in (1, 3, 4, 17):
                    for dtype in (torch.float16, torch.bfloat16):
                        x = torch.randn(rows, k, device="cuda", generator=gen).to(dtype)
                        y = fn(x, wp, sc, zp, gi, gs, bits)
                        if y is None:  # kernel does not cover this case (e.g. CUDA GEMV at 17 rows or 8 bits)
                            continue
                        ref = reference.matmul(x, wp, sc, zp, gi, gs, bits, k)
                        err = (y.float() - ref).abs().max().item() / ref.abs().max().item()
                        tol = 1e-2 if dtype == torch.bfloat16 else 2e-3  # output rounding + low-precision weights
                        if not err <= tol:
                            raise AssertionError(f"bits={bits} g={gs} sym={sym} g_idx={gflag} rows={rows} "
                                                 f"{dtype}: rel err {err:.3g} > {tol}")
            status[name] = "ok"
        except Exception as e:
            status[name] = f"FAILED: {e}"
            traceback.print_exc()
    return status


def dequant_correctness() -> dict:
    from quantkit.kernels import reference

    gen = torch.Generator(device="cuda").manual_seed(1)
    out = {}
    mods = {}
    try:
        from quantkit.kernels import triton as qt

        mods["triton"] = qt
    except Exception as e:
        out["triton dequant"] = f"unavailable: {e}"
    try:
        from quantkit.kernels import cuda as qc

        mods["cuda"] = qc
    except Exception as e:
        out["cuda dequant"] = f"unavailable: {e}"
    for name, mod in mods.items():
        try:
            for bits, gs, sym in ((4, 128, False), (8, 64, True), (4, -1, True)):
                wp, sc, zp = _random_packed(300, 512, bits, gs, sym, "cuda", gen)
                ref = reference.dequantize(wp, sc, zp, None, gs, bits, 512)
                for dt in (torch.float16, torch.bfloat16):
                    got = mod.dequantize_int(wp, sc, zp, None, gs, bits, 512, out_dtype=dt)
                    assert torch.equal(got, ref.to(dt)), f"int{bits} g{gs} {dt}"
            codes = torch.arange(256, dtype=torch.uint8, device="cuda").reshape(8, 32)
            w8 = codes.view(torch.float8_e4m3fn)
            s = torch.rand(8, 1, device="cuda", generator=gen)
            got = mod.dequantize_fp8(w8, s, torch.float32)
            want = reference.dequantize_fp8(w8, s)
            assert torch.equal(got.nan_to_num(), want.nan_to_num()), "fp8"
            out[f"{name} dequant"] = "ok"
        except Exception as e:
            out[f"{name} dequant"] = f"FAILED: {e}"
            traceback.print_exc()
    return out


def build_kernels() -> dict:
    kernels = {}
    try:
        from quantkit.kernels.triton import wna16_matmul

        kernels["triton"] = lambda x, wp, sc, zp, gi, gs, bits: wna16_matmul(x, wp, sc, zp, gi, gs, bits)
    except Exception as e:
        print(f"triton unavailable: {e}")
    try:
        t0 = time.time()
        from quantkit.kernels import cuda as qc

        qc.load()
        print(f"CUDA extension built/loaded in {time.time() - t0:.0f} s")

        def cuda_gemv(x, wp, sc, zp, gi, gs, bits):
            if not qc.gemv_supported(x.shape[-1], gs, gi is not None, bits, x.shape[0], x.dtype):
                return None
            return qc.gemv_w4a16(x, wp, sc, zp, gi, gs)

        kernels["cuda-gemv"] = cuda_gemv
    except Exception as e:
        print(f"CUDA kernels unavailable: {e}")
        traceback.print_exc()
    return kernels


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="first two shapes and 20 iterations only")
    ap.add_argument("--iters", type=int, default=100)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/kernels.py needs a CUDA GPU (torch.cuda.is_available() is False here); "
                 "run it on the GPU machine, or bench/kernels_cpu.py for the CPU paths")
    t_start = time.time()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    kernels = build_kernels()
    status = correctness(kernels)
    status.update(dequant_correctness())
    print("\n## correctness against reference")
    for name, s in status.items():
        print(f"- {name}: {s}")
    bw = copy_bandwidth()
    print(f"\ncopy bandwidth: {bw:.0f} GB/s (1 GiB device-to-device, read + write)\n")
    shapes = SHAPES[:2] if args.quick else SHAPES
    iters = 20 if args.quick else args.iters
    from quantkit.kernels.triton import dequantize_int, wna16_matmul

    timed = [name for name in ("triton", "cuda-gemv") if status.get(name) == "ok"]
    dequant_ok = status.get("triton dequant") == "ok"
    print("| in x out | rows | kernel | us | GB/s | of copy BW | speedup vs fp16 |")
    print("|---|---|---|---|---|---|---|")
    gen = torch.Generator(device="cuda").manual_seed(2)
    for k, n in shapes:
        w16 = torch.randn(n, k, device="cuda", dtype=torch.float16, generator=gen)
        wp, sc, zp = _random_packed(n, k, 4, 128, True, "cuda", gen)
        copies16 = max(1, min(8, -(-L2_DEFEAT_BYTES // w16.nbytes)))
        copies4 = max(1, min(32, -(-L2_DEFEAT_BYTES // wp.nbytes)))
        w16s = [w16] + [w16.clone() for _ in range(copies16 - 1)]
        packs = [(wp, sc)] + [(wp.clone(), sc.clone()) for _ in range(copies4 - 1)]
        buf = torch.empty(n, k, device="cuda", dtype=torch.float16)
        for rows in ROWS:
            xs = [torch.randn(rows, k, device="cuda", dtype=torch.float16, generator=gen) for _ in range(8)]
            io = 2 * rows * (k + n)
            q_bytes = wp.nbytes + sc.nbytes + io
            t16 = _events_median_us(lambda i: xs[i % 8] @ w16s[i % copies16].t(), iters)
            results = [("fp16 matmul", t16, w16.nbytes + io)]
            if "triton" in timed:
                results.append(("triton fused", _events_median_us(
                    lambda i: wna16_matmul(xs[i % 8], *packs[i % copies4], None, None, 128, 4), iters), q_bytes))
            if "cuda-gemv" in timed and rows <= 4:
                from quantkit.kernels.cuda import gemv_w4a16

                results.append(("cuda gemv", _events_median_us(
                    lambda i: gemv_w4a16(xs[i % 8], *packs[i % copies4], None, None, 128), iters), q_bytes))
            if dequant_ok:
                def deq_mm(i):
                    p, s = packs[i % copies4]
                    dequantize_int(p, s, None, None, 128, 4, k, out=buf)
                    return xs[i % 8] @ buf.t()

                results.append(("triton dequant + cuBLAS", _events_median_us(deq_mm, iters), q_bytes))
            for name, us, nbytes in results:
                gbs = nbytes / (us * 1e-6) / 1e9
                print(f"| {k}x{n} | {rows} | {name} | {us:.1f} | {gbs:.0f} | {gbs / bw:.0%} | {t16 / us:.2f}x |",
                      flush=True)
        del w16s, packs, buf
        torch.cuda.empty_cache()
    print(f"\ntotal {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
