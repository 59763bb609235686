"""Prefill throughput of W8A8 INT8 against float on the CPU: tokens/s over one 512-token prompt, in quantkit's
runtime and in vLLM's CPU build.

    python bench/w8a8_prefill.py [--tokens 512] [--repeat 5] [--threads 2] [--vllm-python .venv-vllm/bin/python]

Checkpoints (embedded SmolLM2-135M, bfloat16 storage) are written under bench/out/w8a8-prefill: w8a8 RTN (the
speed does not depend on how the weights were solved). quantkit: quantkit.load (float: the model as loaded, in
float32 and in bfloat16; w8a8: Int8Linear, torch._int_mm with per-token int8 activations), one forward over the
prompt, best of --repeat after a warm-up. vLLM: LLM(...).generate on the same token ids with max_tokens=1 (prefill
plus one sampled token), best of --repeat; each engine in a process of its own.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out" / "w8a8-prefill"
sys.path.insert(0, str(ROOT))

VLLM_SCRIPT = r"""
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
path, dtype, n, repeat = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
llm = LLM(model=path, dtype=dtype, max_model_len=n + 16, enforce_eager=True, seed=0, max_num_seqs=1)
ids = [(i * 7919) % 30000 + 100 for i in range(n)]
sp = SamplingParams(max_tokens=1, temperature=0)
llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)
times = []
for _ in range(repeat):
    t = time.perf_counter(); llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)
    times.append(time.perf_counter() - t)
print("RESULT " + json.dumps({"seconds": min(times)}))
"""


def checkpoints() -> dict[str, Path]:
    from quantkit.job import quantize_to_checkpoint
    from quantkit.models.embedded import embedded_model_dir
    from quantkit.recipe import Recipe, apply_overrides

    out = OUT / "w8a8-bf16"
    OUT.mkdir(parents=True, exist_ok=True)
    if not (out / "quantkit.json").is_file():
        quantize_to_checkpoint(apply_overrides(Recipe(), {"quant.scheme": "w8a8", "dtype": "bfloat16",
                                                          "output": str(out), "overwrite": True}))
    return {"float": Path(embedded_model_dir()), "w8a8": out}


def quantkit_prefill(path: Path, dtype, n: int, repeat: int) -> float:
    import torch

    import quantkit

    model = quantkit.load(path, dtype=dtype, exact=True).eval()
    ids = torch.tensor([[(i * 7919) % 30000 + 100 for i in range(n)]])
    times, cpu = [], []
    with torch.inference_mode():
        model(ids)
        for _ in range(repeat):
            t, c = time.perf_counter(), time.process_time()
            model(ids)
            times.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
    # CPU seconds beside wall seconds: on a shared machine the wall time is mostly the neighbours'
    return min(times), min(cpu)


def vllm_prefill(python: str, path: Path, n: int, repeat: int) -> float | str:
    from quantkit.evaluate.backends import VLLM_ENV

    proc = subprocess.run([python, "-c", VLLM_SCRIPT, str(path), "bfloat16", str(n), str(repeat)],
                          capture_output=True, text=True, env={**os.environ, **VLLM_ENV}, timeout=900)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        return "failed: " + (proc.stderr.strip().splitlines() or ["?"])[-1][:200]
    return json.loads(line[7:])["seconds"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vllm-python", default=None, help="vLLM's venv python; no vLLM rows without it")
    a = ap.parse_args()
    import torch

    torch.set_num_threads(a.threads)
    paths = checkpoints()
    rows = []
    for label, key, dtype in [("float32", "float", torch.float32), ("bfloat16", "float", torch.bfloat16),
                              ("w8a8 (int8 x int8, float32 around it)", "w8a8", torch.float32),
                              ("w8a8 (int8 x int8, bfloat16 around it)", "w8a8", torch.bfloat16)]:
        s, c = quantkit_prefill(paths[key], dtype, a.tokens, a.repeat)
        rows.append(("quantkit", label, s, c))
        print(f"quantkit {label}: {a.tokens / s:.0f} tok/s, {c:.3f} CPU s", file=sys.stderr, flush=True)
    if a.vllm_python:
        for label, key in [("bfloat16", "float"), ("w8a8 (oneDNN int8)", "w8a8")]:
            s = vllm_prefill(a.vllm_python, paths[key], a.tokens, a.repeat)
            rows.append(("vLLM CPU", label, s, None))
            print(f"vLLM {label}: {s}", file=sys.stderr, flush=True)
    print(f"| engine | model | prefill wall s ({a.tokens} tokens) | tokens/s (wall) | CPU s | tokens per CPU s |\n"
          "|---|---|---:|---:|---:|---:|")
    for engine, label, s, c in rows:
        cells = (f"{s:.3f} | {a.tokens / s:.0f}" if isinstance(s, float) else f"{s} | -")
        cpu = "- | -" if c is None else f"{c:.3f} | {a.tokens / c:.0f}"
        print(f"| {engine} | {label} | {cells} | {cpu} |")
    print(f"\nthreads: {a.threads}; load average at the end: {' '.join(open('/proc/loadavg').read().split()[:3])}")


if __name__ == "__main__":
    main()
