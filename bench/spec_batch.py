"""Where speculation stops paying as the batch grows: the engine's aggregate tokens/s with and without it.

Usage: python bench/spec_batch.py [--batches 1,2,4,8,16] [--tokens 48] [--threads 1] [--draft lookup|self-w4]
                                 [--model embedded|CHECKPOINT]

N code-editing requests (bench/prompts/code_edit.jsonl, cycled) are submitted to one Engine at once and decoded
greedily to the end; the row is total output tokens / wall time from submission to the last token. "on" lets
every step speculate (spec_max_batch = N), "off" never (spec_max_batch = 0). `quantkit serve --spec-max-batch`
should sit below the first N where "on" loses.
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from common import prompt_ids  # noqa: E402
from quantkit.open_model import open_model  # noqa: E402
from quantkit.runtime.engine import Engine  # noqa: E402
from quantkit.runtime.sampling import SamplingParams  # noqa: E402
from quantkit.drafts import self_w4_draft  # noqa: E402
from quantkit.drafts.model_draft import ModelDrafter  # noqa: E402


def run(model, tok, prompts, n: int, tokens: int, factory, k: int, speculate: bool) -> float:
    engine = Engine(model, tok, drafter_factory=factory, num_speculative_tokens=k,
                    spec_max_batch=n if speculate else 0, max_active=n, max_queue=n)
    done = threading.Event()
    left = [n]
    lock = threading.Lock()
    out_tokens = [0]

    def on_event(kind, payload):
        if kind == "tokens":
            with lock:
                out_tokens[0] += len(payload)
        elif kind in ("done", "error"):
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    done.set()

    t = time.perf_counter()
    for i in range(n):
        ids = prompts[i % len(prompts)]
        engine.submit(engine.new_sequence(ids, SamplingParams(max_tokens=tokens)), on_event)
    done.wait()
    secs = time.perf_counter() - t
    engine.close()
    return out_tokens[0] / secs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--draft", choices=["lookup", "self-w4"], default="lookup")
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--model", default="embedded", help="the served model: 'embedded' (float32) or a checkpoint")
    a = ap.parse_args()
    opened = open_model(a.model, dtype="float32", threads=a.threads, prompt_lookup=3 if a.draft == "lookup" else None)
    model, tok = opened.model, opened.tokenizer
    prompts = prompt_ids(tok, "code_edit")
    factory = opened.make_drafter
    if a.draft == "self-w4":  # the fake-quantised draft (float Linears), not serve's packed one
        draft = self_w4_draft(model)
        factory = lambda: ModelDrafter(draft)  # noqa: E731
    run(model, tok, prompts, 1, 4, None, a.k, False)  # warm-up
    print(f"{a.model}, torch threads {torch.get_num_threads()}, draft {a.draft}, k={a.k}, {a.tokens} tokens per request, "
          "code_edit prompts, greedy")
    print("| concurrent requests | tok/s speculation off | tok/s speculation on | on / off |")
    print("|---|---|---|---|")
    for n in [int(b) for b in a.batches.split(",")]:
        off = run(model, tok, prompts, n, a.tokens, factory, a.k, False)
        on = run(model, tok, prompts, n, a.tokens, factory, a.k, True)
        print(f"| {n} | {off:.1f} | {on:.1f} | {on / off:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
