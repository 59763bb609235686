"""Speculative decoding on the three prompt sets: tokens/s and tokens per target forward.

Usage: python bench/speculative.py [--w4 CHECKPOINT] [--tokens 64] [--prompts 2] [-k 4] [--repeat 1] [--ours-only]
       [--dtype float32|bfloat16|float16] [--compile]
Rows: no speculation; prompt lookup; self-w4 draft (the target's own W4 RTN weights, packed in memory as
`--draft self-w4` makes them: no second small model with this tokenizer exists here, so this is the draft model
row); the W4 checkpoint as draft when --w4 is given; transformers' generate plain, with prompt_lookup_num_tokens and with
assistant_model (the same self-w4 copy) as the reference, run on the model as transformers itself loads it (our
runtime's copy has re-laid-out Linears, which would speed transformers up too). The target holds the float16
checkpoint's weights in float16 (FBGEMM) unless --float32-weights. Greedy, so every row produces the
same text.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from common import SETS, decode_hf, decode_ours, half_weights, prompt_ids  # noqa: E402
from quantkit.open_model import open_model  # noqa: E402
import quantkit  # noqa: E402
from quantkit.dtypes import parse_dtype  # noqa: E402
from quantkit.runtime.checkpoint import resolve_path  # noqa: E402
from quantkit.runtime.sequence import eos_ids  # noqa: E402
from quantkit.runtime.sampling import SamplingParams  # noqa: E402
from quantkit.drafts.model_draft import ModelDrafter  # noqa: E402
from quantkit.drafts.prompt_lookup import PromptLookupDrafter  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--w4", help="W4 checkpoint folder to use as a real (packed) draft model")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--ngram", type=int, default=3)
    ap.add_argument("--sets", default=",".join(SETS), help="comma list of prompt sets")
    ap.add_argument("--lookup-k", type=int, default=8,
                    help="also run prompt lookup with this many drafted tokens (a free draft can afford more)")
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds over all methods in turn; the median round is shown, with the range")
    ap.add_argument("--ours-only", action="store_true", help="leave out transformers' rows")
    ap.add_argument("--float32-weights", action="store_true",
                    help="hold the target's weights in float32 (oneDNN's layout) instead of float16 (FBGEMM): the "
                         "runtime's layout for float32 checkpoints, and for float16 ones before FBGEMM")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile the target's decode and verify steps (`--compile`); compiled in the warm-up")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="dtype of the target (and of transformers' reference model)")
    a = ap.parse_args()
    dtype = parse_dtype(a.dtype)
    with half_weights(not a.float32_weights):  # the target as `quantkit serve --draft self-w4` opens it
        opened = open_model("embedded", dtype=a.dtype, threads=a.threads or None, draft="self-w4",
                            compile=a.compile)
    model, tok = opened.model, opened.tokenizer
    eos = eos_ids(model, tok)
    draft = opened.make_drafter().model  # the packed self-W4 model every drafter of this run shares
    from transformers import AutoModelForCausalLM

    stock = AutoModelForCausalLM.from_pretrained(resolve_path("embedded"), dtype=dtype).eval()
    w4 = quantkit.load(a.w4, dtype=torch.float32) if a.w4 else None
    k = a.k
    print(f"{a.dtype} target{' --compile' if a.compile else ''}, torch threads: {torch.get_num_threads()}, {a.prompts} prompts per set, up to {a.tokens} tokens, "
          f"greedy, k={k}, prompt-lookup n-gram {a.ngram}; decode tok/s leaves out the prefill")
    print("| prompt set | method | decode tok/s | speed-up vs ours plain | tok/s with prefill | "
          "tokens per target forward | same text |")
    print("|---|---|---|---|---|---|---|")
    with torch.inference_mode():
        # warm-up, with verify steps of several lengths: with --compile, the compiling happens here
        decode_ours(model, prompt_ids(tok, "open_prose", 1), SamplingParams(max_tokens=4), k, None, eos)
        for lookup_k in (k, a.lookup_k):
            decode_ours(model, prompt_ids(tok, "code_edit", 1), SamplingParams(max_tokens=24), lookup_k,
                        lambda: PromptLookupDrafter(a.ngram), eos)
        for name in a.sets.split(","):
            prompts = prompt_ids(tok, name, a.prompts)
            params = SamplingParams(max_tokens=a.tokens)

            def ours(k, make_drafter):
                return decode_ours(model, prompts, params, k, make_drafter, eos)

            methods = [("quantkit, no speculation", lambda: ours(k, None)),
                       (f"quantkit, prompt lookup k={k}", lambda: ours(k, lambda: PromptLookupDrafter(a.ngram))),
                       (f"quantkit, prompt lookup k={a.lookup_k}",
                        lambda: ours(a.lookup_k, lambda: PromptLookupDrafter(a.ngram))),
                       ("quantkit, self-w4 draft (packed)", lambda: ours(k, lambda: ModelDrafter(draft)))]
            if w4 is not None:
                methods.append(("quantkit, W4 checkpoint draft", lambda: ours(k, lambda: ModelDrafter(w4))))
            if not a.ours_only:
                methods += [("transformers generate", lambda: decode_hf(stock, prompts, a.tokens)),
                            (f"transformers prompt_lookup_num_tokens={k}",
                             lambda: decode_hf(stock, prompts, a.tokens, prompt_lookup_num_tokens=k)),
                            (f"transformers prompt_lookup_num_tokens={a.lookup_k}",
                             lambda: decode_hf(stock, prompts, a.tokens, prompt_lookup_num_tokens=a.lookup_k)),
                            ("transformers assistant_model (self-w4)",
                             lambda: decode_hf(stock, prompts, a.tokens, assistant_model=draft))]
            # every method once per round, in turn, so that the VM's drifting speed (~10-30% within minutes here)
            # falls on all of them alike; the median round is reported
            runs = [[] for _ in methods]
            for _ in range(a.repeat):
                for i, (_, run) in enumerate(methods):
                    runs[i].append(run())
            rows = [(m, sorted(r, key=lambda x: x[0])[len(r) // 2]) for (m, _), r in zip(methods, runs)]
            base_speed, _, _, base_out = rows[0][1]
            for (method, (speed, with_prefill, tpf, outs)), r in zip(rows, runs):
                tpf_s = f"{tpf:.2f}" if tpf is not None else "-"
                spread = f" ({min(x[0] for x in r):.1f}-{max(x[0] for x in r):.1f})" if a.repeat > 1 else ""
                print(f"| {name} | {method} | {speed:.1f}{spread} | {speed / base_speed:.2f}x | {with_prefill:.1f} | "
                      f"{tpf_s} | {'yes' if outs == base_out else 'no'} |", flush=True)

if __name__ == "__main__":
    main()
