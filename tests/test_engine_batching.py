"""Continuous batching: concurrent requests share one forward per decode step and get their answers alone."""
from __future__ import annotations

import torch

from helpers import EngineRequests, NumberTokenizer, run_together_as_alone
from quantkit.runtime import llama_step
from quantkit.runtime.engine import Engine
from quantkit.runtime.generate import generate
from quantkit.runtime.sampling import SamplingParams
from quantkit.drafts.prompt_lookup import PromptLookupDrafter
from quantkit.testing.models import single_thread, tiny_llama


def test_requests_share_decode_forwards_and_join_and_leave_between_steps(monkeypatch):
    model = tiny_llama(vocab_size=64, seed=4, init_std=0.2)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 64, (n,), generator=g).tolist() for n in (5, 9, 3, 12, 7, 4)]
    lengths = [6, 14, 10, 3, 20, 8]  # requests finish at different steps and leave the batch
    sizes, real = [], llama_step.forward_batch
    monkeypatch.setattr(llama_step, "forward_batch", lambda m, items, last: sizes.append(len(items)) or real(m, items, last))
    engine = Engine(model, NumberTokenizer(), max_active=8)
    run = EngineRequests(engine)
    with single_thread():
        run.submit_together(prompts[:4], lengths[:4])  # they prefill, then decode together
        run.wait(1)  # the shortest one has finished and left; two more join mid-flight
        for ids, n in zip(prompts[4:], lengths[4:]):
            run.submit(ids, n)
        run.wait()
        engine.close()
        for ids, n, req in zip(prompts, lengths, run.reqs):
            alone = generate(model, ids, SamplingParams(max_tokens=n, ignore_eos=True)).output_ids()
            assert req.seq.output_ids() == alone
    assert max(sizes) >= 4  # one forward carried four requests' decode rows
    assert sum(1 for s in sizes if s == 1) >= len(prompts)  # the prefills, each alone
    assert llama_step.pool_for(model).n_live() == 0  # every finished request gave its slot back


def test_speculating_and_plain_rows_share_a_padded_forward():
    model = tiny_llama(vocab_size=64, seed=6, init_std=0.2)
    g = torch.Generator().manual_seed(7)
    chunk = torch.randint(1, 64, (8,), generator=g).tolist()
    prompts = [chunk + [2] + chunk[:3], torch.randint(1, 64, (6,), generator=g).tolist(), chunk * 2]
    engine = Engine(model, NumberTokenizer(), drafter_factory=lambda: PromptLookupDrafter(3, min_ngram=1),
                    num_speculative_tokens=4, max_active=8)
    run = run_together_as_alone(engine, model, prompts, 16)
    assert sum(r.seq.metrics.spec_steps for r in run.reqs) > 0


def test_a_failing_request_does_not_fail_the_others_in_its_step():
    """On transformers' path (models our forward does not cover) requests are stepped one by one; when one's
    forward raises, only that request gets the error."""
    from transformers import AutoModelForCausalLM, DynamicCache

    from helpers import tiny_config

    class Boom(DynamicCache):
        def __init__(self, config):
            super().__init__(config=config)
            self.updates = 0

        def update(self, *a, **kw):
            self.updates += 1
            if self.updates > 6:  # 2 layers: the prefill and two decode steps, then it fails
                raise RuntimeError("boom")
            return super().update(*a, **kw)

    torch.manual_seed(2)
    model = AutoModelForCausalLM.from_config(tiny_config("phi3", vocab_size=64, layers=2)).eval()
    assert not llama_step.supports(model)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 64, (6,), generator=g).tolist() for _ in range(3)]
    engine = Engine(model, NumberTokenizer(), max_active=8)
    run = EngineRequests(engine)
    with single_thread():
        with engine._cv:
            run.submit(prompts[0], 6, prepare=lambda seq: setattr(seq, "cache", Boom(model.config)))
            run.submit_together(prompts[1:], 6)
        run.wait()
        engine.close()
        assert run.kinds == {0: "error", 1: "done", 2: "done"}
        for ids, req in zip(prompts[1:], run.reqs[1:]):
            assert req.seq.output_ids() == generate(model, ids, SamplingParams(max_tokens=6, ignore_eos=True)).output_ids()


def test_a_draft_model_gives_its_slots_back_when_requests_finish():
    from quantkit.drafts.model_draft import ModelDrafter

    target = tiny_llama(vocab_size=64, seed=8, init_std=0.2)
    draft = tiny_llama(vocab_size=64, seed=9, init_std=0.2)
    engine = Engine(target, NumberTokenizer(), drafter_factory=lambda: ModelDrafter(draft), num_speculative_tokens=3)
    run = EngineRequests(engine)
    with single_thread():
        for i in range(3):
            run.submit([5, 6, 7, 8 + i], 10)
        run.wait()
        engine.close()
    assert all(r.seq.finish_reason == "length" for r in run.reqs)
    # released when each request finished, not whenever the garbage collector gets to the engine's locals
    assert llama_step.pool_for(draft).n_live() == 0 and llama_step.pool_for(target).n_live() == 0
