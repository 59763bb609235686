"""Decode speed of the runtime next to the weight-reading limit and transformers' generate.

Usage: python bench/decode.py [--w4 CHECKPOINT] [--tokens 48] [--prompts 2]
Two limits, both bytes of weights read per token over a bandwidth measured in this run: the issue's, over the
copy bandwidth counted as bytes copied per second (a 512 MB tensor copy; the issue's "limit near 23 tok/s" for
538 MB is this one), and a stricter one over the read bandwidth (a sum over 512 MB: a decode step reads its
weights and writes next to nothing), which on this machine is about twice the copy rate. "transformers" is the
checkpoint loaded by transformers itself (compressed-tensors dequantises it to float32 on a CPU) and decoded by
its plain generate, what a user without quantkit runs; "transformers, our modules" is generate over the model quantkit loaded.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from common import (copy_bandwidth, decode_hf, decode_ours, half_weights, prompt_ids, read_bandwidth,  # noqa: E402
                    weight_bytes_per_token)
import quantkit  # noqa: E402
from quantkit.runtime import build  # noqa: E402
from quantkit.runtime.sampling import SamplingParams  # noqa: E402


def ours(model, prompts, n):
    return decode_ours(model, prompts, SamplingParams(max_tokens=n, ignore_eos=True), 1, None, set())[0]


def hf(model, prompts, n):
    return decode_hf(model, prompts, n, min_new_tokens=n)[0]


def transformers_model(path: str):
    from transformers import AutoModelForCausalLM

    from quantkit.models.embedded import embedded_model_dir

    src = str(embedded_model_dir()) if path == "embedded" else path
    kw = {}
    if path != "embedded":
        from transformers import CompressedTensorsConfig

        # dequantised once at load: faster on a CPU than its default compressed modules, which decompress the
        # weights in every forward, so the comparison is against transformers' better option
        kw["quantization_config"] = CompressedTensorsConfig(dequantize=True)
    return AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, **kw).eval()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--w4", help="W4 checkpoint folder (quantkit quantize ... --scheme w4a16)")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    ap.add_argument("--compile", action="store_true", help="also time each model with --compile (torch.compile)")
    ap.add_argument("--float32-weights", action="store_true",
                    help="also time the float model with its weights held in float32 (oneDNN's layout), as before "
                         "the runtime held float16 checkpoints' weights in float16 (FBGEMM)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    tok = build.load_tokenizer("embedded")
    prompts = prompt_ids(tok, "open_prose", a.prompts)
    bw, copy_bw = read_bandwidth(), copy_bandwidth()
    rows = []
    # the float model is SmolLM2 as stored (float16) run in float32: the runtime holds its weights in float16 and
    # multiplies in float32 (linear/half_weight.py), transformers holds them in float32
    variants = [("float (fp16 weights, fp32 products)", "embedded", True)]
    if a.float32_weights:
        variants.append(("float (fp32 weights, oneDNN)", "embedded", False))
    if a.w4:
        variants.append(("w4a16", a.w4, True))
    if a.compile:
        variants = [(n + c, p, h) for n, p, h in variants for c in ("", " --compile")]
    with torch.inference_mode():
        for name, path, hold_half in variants:
            with half_weights(hold_half):
                model = quantkit.load(path, dtype=torch.float32)
            wb = weight_bytes_per_token(model)  # before compiling: the compiled forward holds the same tensors
            if name.endswith("--compile") and not build.compile_decode(model):
                print(f"{name}: stays eager (FBGEMM / oneDNN products; build.compile_decode), row left out")
                continue
            ours(model, prompts[:1], 4)  # warm-up (and, compiled, the compilation)
            limit = bw / wb
            limit_copy = copy_bw / 2 / wb  # copy_bandwidth counts read + write; the issue counts bytes copied
            o = ours(model, prompts, a.tokens)
            if name.endswith("--compile"):
                # transformers' side is the uncompiled row's (generate would only recompile for its own calls)
                h, h_ours = rows[-1][5], None
            else:
                h_ours = hf(model, prompts, a.tokens)
                plain = transformers_model(path)
                h = hf(plain, prompts, a.tokens)
                del plain
            del model
            rows.append((name, wb / 1e6, limit_copy, limit, o, h, h_ours))
    print(f"torch threads: {torch.get_num_threads()}, read bandwidth {bw / 1e9:.1f} GB/s, copy bandwidth "
          f"(read + write) {copy_bw / 1e9:.1f} GB/s, {a.prompts} prompts x {a.tokens} tokens, greedy, decode only")
    print("| model | weight MB/token | quantkit tok/s | limit tok/s (copy) | % of copy limit | limit tok/s (read) | "
          "% of read limit | transformers tok/s | speed-up | transformers, our modules tok/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, mb, limit_copy, limit, o, h, h_ours in rows:
        print(f"| {name} | {mb:.0f} | {o:.1f} | {limit_copy:.1f} | {100 * o / limit_copy:.0f}% | {limit:.1f} | "
              f"{100 * o / limit:.0f}% | {h:.1f} | {o / h:.2f}x | {'-' if h_ours is None else format(h_ours, '.1f')} |")


if __name__ == "__main__":
    main()
