"""Both trained-or-cut draft sources on the embedded SmolLM2 as the runtime loads it (re-laid weights, float16
head copy, padded slot steps): greedy output equals plain decoding."""
import torch

from quantkit.drafts.eagle_draft import EagleDrafter
from quantkit.drafts.eagle_head import new_head
from quantkit.open_model import open_model
from quantkit.runtime.generate import generate
from quantkit.runtime.sampling import SamplingParams
from quantkit.testing.models import single_thread


def test_greedy_with_early_exit_and_a_head_on_the_embedded_model():
    opened = open_model("embedded", draft="early-exit:10")
    model, tok = opened.model, opened.tokenizer
    head = new_head(model, seed=0).eval().requires_grad_(False)  # untrained: drafts mostly refused, still exact
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a quiet village,"]
    with single_thread(), torch.inference_mode():
        for text in texts:
            ids = tok(text)["input_ids"]
            plain = generate(model, ids, SamplingParams(max_tokens=10)).output_ids()
            for drafter in (opened.make_drafter(), EagleDrafter(model, head)):
                seq = generate(model, ids, SamplingParams(max_tokens=10), drafter=drafter, cost_aware=False)
                assert seq.output_ids() == plain, (text, type(drafter).__name__)
                assert seq.metrics.spec_steps > 0
