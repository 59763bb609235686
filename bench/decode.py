"""Decode speed of the runtime next to the weight-reading limit and transformers' generate.

Usage: python bench/decode.py [--w4 CHECKPOINT] [--tokens 48] [--prompts 2]
The limit is bytes of weights read per token / copy bandwidth measured in this run.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from common import copy_bandwidth, prompt_ids, weight_bytes_per_token  # noqa: E402
from quantkit.runtime import build  # noqa: E402
from quantkit.runtime.generate import generate  # noqa: E402
from quantkit.runtime.sampling import SamplingParams  # noqa: E402


def ours(model, prompts, n):
    toks, secs = 0, 0.0
    for ids in prompts:
        seq = generate(model, ids, SamplingParams(max_tokens=n, ignore_eos=True), eos=set())
        toks += seq.metrics.output_tokens - 1
        secs += seq.metrics.t_last - seq.metrics.t_first  # decode only: prefill excluded
    return toks / secs


def hf(model, prompts, n):
    # Total time includes one prefill; subtract it (measured separately) so both columns are decode-only.
    toks, secs = 0, 0.0
    for ids in prompts:
        x = torch.tensor([ids])
        t = time.perf_counter()
        model(x, logits_to_keep=1)
        pre = time.perf_counter() - t
        t = time.perf_counter()
        model.generate(x, do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
        secs += time.perf_counter() - t - pre
        toks += n - 1
    return toks / secs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--w4", help="W4 checkpoint folder (quantkit quantize ... --scheme w4a16)")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    tok = build.load_tokenizer("embedded")
    prompts = prompt_ids(tok, "open_prose", a.prompts)
    bw = copy_bandwidth()
    rows = []
    variants = [("float32", "embedded")] + ([("w4a16", a.w4)] if a.w4 else [])
    with torch.inference_mode():
        for name, path in variants:
            model = build.load_model(path, torch.float32)
            ours(model, prompts[:1], 4)  # warm-up
            wb = weight_bytes_per_token(model)
            limit = bw / wb
            o = ours(model, prompts, a.tokens)
            h = hf(model, prompts, a.tokens)
            rows.append((name, wb / 1e6, limit, o, h))
    print(f"torch threads: {torch.get_num_threads()}, copy bandwidth (read+write): {bw / 1e9:.1f} GB/s, "
          f"{a.prompts} prompts x {a.tokens} tokens, greedy, decode only")
    print(f"| model | weight MB/token | limit tok/s | quantkit tok/s | % of limit | transformers generate tok/s | speed-up |")
    print("|---|---|---|---|---|---|---|")
    for name, mb, limit, o, h in rows:
        print(f"| {name} | {mb:.0f} | {limit:.1f} | {o:.1f} | {100 * o / limit:.0f}% | {h:.1f} | {o / h:.2f}x |")


if __name__ == "__main__":
    main()
