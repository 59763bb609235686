"""Trained EAGLE head and early-exit drafts against plain decoding and prompt lookup, on the three prompt sets.

Usage: python bench/draft_head.py --head HEAD [--head2 OTHER] [--early-exit 8] [--tokens 32] [--prompts 2] [-k 4]
       [--threads 1,2] [--temperature 0.7] [--train-steps 200 ...]
       python bench/draft_head.py --coverage 1024,2048,4096,8192 --train-data TEXT   (choosing --draft-vocab)
Without --head, a head is first trained on the embedded SmolLM2 (`quantkit draft train embedded`, with
--train-data / --train-steps / --train-samples) and its training time reported. Every method decodes the same
prompts with the same sampling parameters; greedy rows must give the plain row's text ("same text"), sampled
rows are exact in distribution (tests/test_draft_*.py), not token for token. Decode tok/s leaves out the
prefill, which the head's drafter repeats once per request for its prompt features.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from common import SETS, decode_ours, prompt_ids  # noqa: E402
from quantkit.drafts import drafter_factory  # noqa: E402
from quantkit.drafts.eagle_train import TrainOptions  # noqa: E402
from quantkit.drafts.train_job import train_draft_head  # noqa: E402
from quantkit.open_model import open_model  # noqa: E402
from quantkit.runtime.sequence import eos_ids  # noqa: E402
from quantkit.runtime.sampling import SamplingParams  # noqa: E402


def _args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--head", help="a trained head folder (default: train one first, into --train-out)")
    ap.add_argument("--head2", help="a second head to compare (e.g. the full-vocabulary one)")
    ap.add_argument("--coverage", help="only report, for these draft vocabulary sizes, the share of the target's "
                                       "greedy answers on the prompt sets inside the vocabulary chosen from "
                                       "--train-data, and the per-token output product's time")
    ap.add_argument("--train-vocab", type=int, default=4096)
    ap.add_argument("--train-out", default="bench/out/smollm2-head")
    ap.add_argument("--train-data", default="self")
    ap.add_argument("--train-samples", type=int, default=96)
    ap.add_argument("--train-seq-len", type=int, default=128)
    ap.add_argument("--train-steps", type=int, default=200)
    ap.add_argument("--early-exit", type=int, default=8, help="layers of the early-exit draft (SmolLM2 has 30)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("-k", type=int, default=4, help="tokens drafted per step by the head and the early exit")
    ap.add_argument("--lookup-k", type=int, default=8)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--temperature", type=float, default=0.7, help="for the sampled rows")
    ap.add_argument("--sets", default=",".join(SETS))
    return ap.parse_args()


def _train(a) -> tuple[str, str]:
    t = time.perf_counter()
    r = train_draft_head("embedded", a.train_out, data=a.train_data, samples=a.train_samples,
                         seq_len=a.train_seq_len, opts=TrainOptions(steps=a.train_steps, vocab=a.train_vocab),
                         device="cpu")
    best = min(r["history"], key=lambda h: h["heldout_loss"])
    note = (f"head trained in {time.perf_counter() - t:.0f} s ({r['data_s']:.0f} s text, {r['feature_s']:.0f} s "
            f"target features, {r['train_s']:.0f} s for {r['steps'] - r['resumed_from']} steps on "
            f"{r['train_tokens']} tokens); held-out top-1 agreement {best['heldout_top1']:.1%}, "
            f"loss {best['heldout_loss']:.3f} (untrained: {r['history'][0]['heldout_loss']:.3f})")
    return a.train_out, note


def _coverage(a):
    """Which N: the share of the target's own greedy tokens on each prompt set that a vocabulary of N tokens,
    chosen from the training text as `quantkit draft train` chooses it, contains (a token outside is never
    drafted, so this bounds the greedy keep rate), and what one drafted token's output product then costs."""
    from quantkit.data.calibration import load_calibration
    from quantkit.drafts.draft_vocab import choose_vocab, gathered_rows, output_matrix
    from quantkit.drafts.eagle_train import _target_top1, target_features

    torch.set_num_threads(1)
    opened = open_model("embedded")
    model, tok = opened.model, opened.tokenizer
    with torch.inference_mode():
        calib = load_calibration(a.train_data, tok, num_samples=a.train_samples, seq_len=a.train_seq_len, seed=0,
                                 model=model)
        ids = torch.stack(calib.samples)
        top1 = _target_top1(target_features(model, list(ids), 8), *output_matrix(model))
        answers = {name: [t for p in prompt_ids(tok, name, a.prompts) for t in decode_ours(
            model, [p], SamplingParams(max_tokens=a.tokens), 1, None, eos_ids(model, tok))[3][0]] for name in SETS}
        g = torch.randn(1, model.config.hidden_size)
        head = model.get_output_embeddings()
        print(f"full vocabulary: output product {_ms(lambda: head(g)):.2f} ms")
        print("| N | " + " | ".join(f"{n} greedy tokens inside" for n in SETS) + " | output product ms |")
        print("|---|" + "---|" * (len(SETS) + 1))
        for n in [int(x) for x in a.coverage.split(",")]:
            vocab = set(choose_vocab(ids, top1, n, model.config.vocab_size).tolist())
            w = gathered_rows(model, torch.tensor(sorted(vocab)))[0]
            share = [sum(t in vocab for t in answers[s]) / len(answers[s]) for s in SETS]
            print(f"| {n} | " + " | ".join(f"{x:.1%}" for x in share) + f" | {_ms(lambda: g @ w.T):.2f} |")


def _vocab(head: str) -> str:
    cfg = json.loads((Path(head) / "config.json").read_text())
    n = cfg.get("draft_vocab_size") or cfg["vocab_size"]
    return "full vocab" if n == cfg["vocab_size"] else f"{n} tokens"


def _ms(fn, n: int = 200) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e3


def main():
    a = _args()
    if a.coverage:
        return _coverage(a)
    head, note = (a.head, "head given") if a.head else _train(a)
    print(note, flush=True)
    opened = open_model("embedded", draft=head)
    model, tok = opened.model, opened.tokenizer
    eos = eos_ids(model, tok)
    early = drafter_factory(model, tok, draft=f"early-exit:{a.early_exit}")
    lookup = drafter_factory(model, tok, prompt_lookup=3)
    methods = [("plain", None, a.k), (f"prompt lookup k={a.lookup_k}", lookup, a.lookup_k),
               (f"early-exit:{a.early_exit} k={a.k}", early, a.k),
               (f"EAGLE head ({_vocab(head)}) k={a.k}", opened.make_drafter, a.k)]
    if a.head2:
        methods.append((f"EAGLE head ({_vocab(a.head2)}) k={a.k}", drafter_factory(model, tok, draft=a.head2), a.k))
    print(f"embedded SmolLM2-135M float32, {a.prompts} prompts per set, up to {a.tokens} tokens; decode tok/s "
          f"leaves out the prefill")
    print("| threads | prompt set | sampling | method | decode tok/s | vs plain | tokens per target forward | "
          "same text |")
    print("|---|---|---|---|---|---|---|---|")
    with torch.inference_mode():
        decode_ours(model, prompt_ids(tok, "open_prose", 1), SamplingParams(max_tokens=4), a.k,
                    opened.make_drafter, eos)  # warm-up
        for threads in [int(x) for x in a.threads.split(",")]:
            torch.set_num_threads(threads)
            for name in a.sets.split(","):
                prompts = prompt_ids(tok, name, a.prompts)
                for mode, params in (("greedy", SamplingParams(max_tokens=a.tokens)),
                                     (f"T={a.temperature}", SamplingParams(max_tokens=a.tokens,
                                                                           temperature=a.temperature, seed=1))):
                    base = None
                    for label, make, k in methods:
                        speed, _, tpf, outs = decode_ours(model, prompts, params, k, make, eos)
                        base = base or (speed, outs)
                        same = ("yes" if outs == base[1] else "NO") if mode == "greedy" else "-"
                        print(f"| {threads} | {name} | {mode} | {label} | {speed:.1f} | {speed / base[0]:.2f}x | "
                              f"{tpf:.2f} | {same} |", flush=True)


if __name__ == "__main__":
    main()
