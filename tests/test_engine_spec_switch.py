"""The engine speculates only while at most spec_max_batch requests are active (`--spec-max-batch`)."""
from __future__ import annotations

import pytest
import torch

from helpers import EngineRequests, NumberTokenizer
from quantkit.runtime.engine import Engine
from quantkit.runtime.generate import generate
from quantkit.runtime.sampling import SamplingParams
from quantkit.drafts.prompt_lookup import PromptLookupDrafter
from quantkit.testing.models import single_thread, tiny_llama


def _prompts(n):
    g = torch.Generator().manual_seed(9)
    out = []
    for _ in range(n):
        chunk = torch.randint(1, 64, (10,), generator=g).tolist()
        out.append(chunk + [5] + chunk + chunk[:2])  # repeats, so prompt lookup has something to propose
    return out


def _run(model, prompts, spec_max_batch):
    engine = Engine(model, NumberTokenizer(), drafter_factory=lambda: PromptLookupDrafter(3, min_ngram=1),
                    num_speculative_tokens=4, spec_max_batch=spec_max_batch, max_active=8)
    run = EngineRequests(engine)
    run.submit_together(prompts, 24)
    run.wait()
    engine.close()
    return [r.seq for r in run.reqs]


@pytest.mark.parametrize("limit,speculates", [(3, True), (2, False)])
def test_speculation_stops_above_the_limit_and_output_is_unchanged(limit, speculates):
    model = tiny_llama(vocab_size=64, seed=3)
    prompts = _prompts(3)
    with single_thread():
        seqs = _run(model, prompts, limit)
        for ids, seq in zip(prompts, seqs):
            assert seq.output_ids() == generate(model, ids, SamplingParams(max_tokens=24, ignore_eos=True)).output_ids()
    spec_steps = sum(s.metrics.spec_steps for s in seqs)
    # three requests of equal length stay active together to the end: with a limit of 2 no step may draft
    assert (spec_steps > 0) is speculates


def test_default_limit_depends_on_the_model_kind(tmp_path, cli):
    """Measured in bench/spec_batch.py: speculation pays up to ~8 requests for a float model in oneDNN's float32
    layout, 3 with float16-held weights, 2 for a W4 checkpoint on a CPU; the engine picks by what the model holds
    unless told."""
    from quantkit.linear import half_weight as half_weight_linear
    from quantkit.linear.dispatch import relayout_model

    import quantkit
    from helpers import make_tiny_model

    float_model = tiny_llama(vocab_size=64, seed=3)
    src = make_tiny_model(tmp_path / "src", "llama")
    out = tmp_path / "w4"
    assert cli("quantize", "--method", "rtn", src, "-o", out, "--quiet", "--group-size", "32")[0] == 0
    w4 = quantkit.load(out, dtype=torch.float32)
    half_model = tiny_llama(vocab_size=64, seed=3, dtype=torch.float16).float()
    relayout_model(half_model)  # every weight a float16 number: held in float16 where FBGEMM is
    engines = [Engine(float_model, NumberTokenizer()), Engine(w4, NumberTokenizer()),
               Engine(w4, NumberTokenizer(), spec_max_batch=5), Engine(half_model, NumberTokenizer())]
    try:
        assert [e.spec_max_batch for e in engines] == [8, 2, 5, 3 if half_weight_linear.available() else 8]
    finally:
        for e in engines:
            e.close()
