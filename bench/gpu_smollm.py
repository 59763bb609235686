"""The GPU checks that need a real model (issue 42), on the embedded SmolLM2-135M, each against the CPU:

    python bench/gpu_smollm.py                 # on a CUDA machine (bench/gpu_check.sh runs it)
    python bench/gpu_smollm.py --device cpu    # dry run here: the same code, the CPU against itself

1. Real weights through the kernels: every Linear kind of the first, a middle and the last layer, quantised to W4
   (groups 32, 48, 64, 128; symmetric and with zero points), through the CUDA GEMV (1-4 rows), the CUDA
   tensor-core GEMM (16 and 64 rows) and Triton (3 rows as GEMV, 40 as GEMM), each against the float64 product of
   the dequantised codes (quantkit.testing.packed: the codes unpacked by the test, not by the kernel).
2. A W4 checkpoint decoded greedily on the device and on the CPU, both in float32: the tokens must agree; the
   float16 run on the device is reported beside it.
3. GPTQ quantised on the CPU and on the device from the same calibration tokens: the share of equal codes, and both
   checkpoints' perplexity scored by the same CPU float32 evaluation, which must agree within 0.1%.
Each check prints one line starting PASS or FAIL; the exit code is the number of FAIL lines.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

GROUPS = (32, 48, 64, 128)
TOL = 3e-3  # float16 output rounding and 16-bit weights, relative to max |y| (tests/test_gpu_kernels.py)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three laws of thermodynamics are", "SELECT name FROM users WHERE", "In 1969, the first humans"]
CALIB = ROOT / "calibration" / "texts" / "prose_calib.txt"
EVAL = ROOT / "bench" / "data" / "eval_prose.txt"
failures = 0


def verdict(ok: bool, line: str) -> None:
    global failures
    failures += not ok
    print(f"{'PASS' if ok else 'FAIL'} {line}", flush=True)


def _kernels(device: str) -> dict:
    """name -> (call(x, packed tensors, group), row counts); CUDA ones only on a GPU, Triton everywhere it runs."""
    from quantkit.kernels.triton import wna16_matmul

    out = {"triton gemv": (lambda x, wp, sc, zp, g: wna16_matmul(x, wp, sc, zp, None, g, 4, variant="gemv"), (3,)),
           "triton gemm": (lambda x, wp, sc, zp, g: wna16_matmul(x, wp, sc, zp, None, g, 4, variant="gemm"), (40,))}
    if device == "cuda":
        from quantkit.kernels import cuda as qc

        out["cuda gemv"] = (lambda x, wp, sc, zp, g: qc.gemv_w4a16(x, wp, sc, zp, None, g), (1, 2, 3, 4))
        out["cuda tensor cores"] = (lambda x, wp, sc, zp, g: qc.gemm_w4a16_tc(x, wp, sc, zp, g), (16, 64))
    return out


def real_weight_kernels(model_dir: Path, device: str) -> None:
    from safetensors import safe_open

    from quantkit.errors import UserError
    from quantkit.testing.packed import make_packed

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        names = list(f.keys())
        layers = sorted({int(n.split(".")[2]) for n in names if n.startswith("model.layers.")})
        picked = [n for n in names if n.endswith("proj.weight") and int(n.split(".")[2]) in
                  (layers[0], layers[len(layers) // 2], layers[-1])]
        weights = {n: f.get_tensor(n) for n in picked}
    kernels = _kernels(device)
    worst = {k: 0.0 for k in kernels}
    refused = {k: set() for k in kernels}
    gen = torch.Generator().manual_seed(0)
    for name, w in weights.items():
        n, k = w.shape
        for group in (g for g in GROUPS if k % g == 0):  # 576 (SmolLM2's width) takes no group of 128
            for symmetric in (True, False):
                p = make_packed(n, k, 4, group, symmetric, weight=w, scale_dtype=torch.float16)
                args = [t.to(device) if t is not None else None for t in
                        (p.weight_packed, p.weight_scale, p.weight_zero_point)]
                for kname, (call, row_counts) in kernels.items():
                    for rows in row_counts:
                        x = torch.randn(rows, k, generator=gen).half()
                        try:
                            y = call(x.to(device), *args, group)
                        except UserError:  # the kernel's own refusal of this group: reported, not failed
                            refused[kname].add(group)
                            continue
                        truth = x.double() @ p.w64.t()
                        err = (y.double().cpu() - truth).abs().max().item() / truth.abs().max().item()
                        worst[kname] = max(worst[kname], err)
    print(f"real weights: {len(weights)} Linears of SmolLM2 ({', '.join(sorted({n.split('.')[-2] for n in weights}))}"
          f"), groups {GROUPS}, symmetric and zero-point, float16")
    for kname, err in worst.items():
        note = f"; refuses group {sorted(refused[kname])}" if refused[kname] else ""
        verdict(err <= TOL, f"{kname} on real SmolLM2 weights: max error {err:.2e} of max abs(y) "
                            f"(tolerance {TOL}){note}")


def _quantise(src: str, out: str, device: str, method: str, **extra) -> float:
    from quantkit.job import quantize_to_checkpoint
    from quantkit.recipe import Recipe, apply_overrides

    t = time.time()
    over = {"model": src, "output": out, "dtype": "float16", "quant.method": method, "device": device, **extra}
    quantize_to_checkpoint(apply_overrides(Recipe(), over))
    return time.time() - t


def _greedy(model, prompts, tokens: int) -> list[list[int]]:
    from quantkit.runtime.generate import generate
    from quantkit.runtime.sampling import SamplingParams

    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    return [generate(model, p, params).output_ids() for p in prompts]


def _agree(a: list[list[int]], b: list[list[int]]) -> tuple[int, int]:
    """Tokens equal up to each prompt's first difference, and the total."""
    same = 0
    for x, y in zip(a, b):
        for s, t in zip(x, y):
            if s != t:
                break
            same += 1
    return same, sum(len(y) for y in b)


def greedy_across_devices(src: str, tmp: Path, device: str, tokens: int) -> None:
    import quantkit
    from quantkit.runtime import build

    w4 = str(tmp / "w4")
    _quantise(src, w4, "cpu", "rtn")
    tok = build.load_tokenizer(src)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    cpu = _greedy(quantkit.load(w4, device="cpu", dtype=torch.float32, exact=True), prompts, tokens)
    dev32 = _greedy(quantkit.load(w4, device=device, dtype=torch.float32), prompts, tokens)
    same, total = _agree(dev32, cpu)
    verdict(same == total, f"W4 SmolLM2 greedy on {device} float32 vs the CPU: {same}/{total} tokens equal "
            f"({len(prompts)} prompts x {tokens})")
    dev16 = _greedy(quantkit.load(w4, device=device, dtype=torch.float16), prompts, tokens)
    same16, _ = _agree(dev16, cpu)
    print(f"info: W4 SmolLM2 greedy on {device} float16 vs the CPU float32: {same16}/{total} tokens equal up to each "
          f"prompt's first difference (float16 rounding may flip a near-tie)")


def gptq_across_devices(src: str, tmp: Path, device: str) -> None:
    import quantkit
    from bench.score import score
    from quantkit.data import load_eval_windows
    from quantkit.formats.compressed_tensors import load_tensors
    from quantkit.runtime import build

    calib = {"calibration.spec": str(CALIB), "calibration.num_samples": 8, "calibration.seq_len": 256}
    secs, ppl, codes = {}, {}, {}
    tok = build.load_tokenizer(src)
    windows = list(load_eval_windows(str(EVAL), tok, seq_len=512, max_windows=6))
    for where in ("cpu", device) if device != "cpu" else ("cpu", "cpu again"):
        out = str(tmp / f"gptq-{where.replace(' ', '-')}")
        secs[where] = _quantise(src, out, where.split()[0], "gptq", **calib)
        codes[where] = {k: v for k, v in load_tensors(Path(out)).items() if k.endswith("weight_packed")}
        ppl[where] = score(quantkit.load(out, device="cpu", dtype=torch.float32, exact=True), windows)["ppl"]
    a, b = list(codes)
    words = sum(t.numel() for t in codes[a].values())
    equal = sum(int((codes[a][k] == codes[b][k]).sum()) for k in codes[a])
    rel = abs(ppl[b] / ppl[a] - 1)
    verdict(rel <= 1e-3, f"GPTQ SmolLM2 quantised on {b} vs {a}: perplexity {ppl[b]:.4f} vs {ppl[a]:.4f} "
            f"({rel:.3%} apart, limit 0.1%; scored on the CPU in float32, {len(windows)} x 512 tokens of "
            f"{EVAL.name}); {equal / words:.1%} of packed code words equal; quantised in {secs[b]:.0f} s vs "
            f"{secs[a]:.0f} s")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="SmolLM2 on a GPU against the CPU: real-weight kernels, greedy decode, "
                                             "GPTQ on the device", epilog="example: python bench/gpu_smollm.py")
    ap.add_argument("--device", default="cuda", help="cuda (default), or cpu for a dry run of the same code")
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    ap.add_argument("--only", default="kernels,greedy,gptq", help="comma list of checks (default: all three)")
    args = ap.parse_args(argv)
    if args.device == "cuda":
        from gpu_timing import require_cuda  # bench/ is this script's folder, so it is on the path

        require_cuda("bench/gpu_smollm.py", "a CUDA GPU (--device cpu is the dry run)")
    from quantkit.models.embedded import embedded_model_dir

    src = embedded_model_dir()
    print(f"device: {torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}, torch {torch.__version__}")
    checks = {"kernels": lambda tmp: real_weight_kernels(src, args.device),
              "greedy": lambda tmp: greedy_across_devices(str(src), tmp, args.device, args.tokens),
              "gptq": lambda tmp: gptq_across_devices(str(src), tmp, args.device)}
    with tempfile.TemporaryDirectory() as tmp:
        for name, check in checks.items():
            if name not in args.only.split(","):
                continue
            t = time.time()
            try:
                check(Path(tmp))
            except Exception as e:  # noqa: BLE001 - one broken check is reported; the others still run
                import traceback

                traceback.print_exc()
                verdict(False, f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
            print(f"({name}: {time.time() - t:.0f} s)", flush=True)
    return failures


if __name__ == "__main__":
    sys.exit(main())
