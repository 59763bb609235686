"""Continuous batching: concurrent requests share one forward per decode step and get their answers alone."""
from __future__ import annotations

import threading

import torch

from helpers import NumberTokenizer
from quantkit.runtime import llama_step
from quantkit.runtime.engine import Engine
from quantkit.runtime.generate import generate
from quantkit.runtime.sampling import SamplingParams
from quantkit.runtime.speculative import PromptLookupDrafter
from quantkit.runtime.tiny import single_thread, tiny_llama


def test_requests_share_decode_forwards_and_join_and_leave_between_steps(monkeypatch):
    model = tiny_llama(vocab_size=64, seed=4, init_std=0.2)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 64, (n,), generator=g).tolist() for n in (5, 9, 3, 12, 7, 4)]
    lengths = [6, 14, 10, 3, 20, 8]  # requests finish at different steps and leave the batch
    sizes, real = [], llama_step.forward_batch
    monkeypatch.setattr(llama_step, "forward_batch", lambda m, items, last: sizes.append(len(items)) or real(m, items, last))
    engine = Engine(model, NumberTokenizer(), max_active=8)
    done = threading.Semaphore(0)
    reqs = []
    with single_thread():
        with engine._cv:  # queue all before the loop admits any: they prefill, then decode together
            for ids, n in zip(prompts[:4], lengths[:4]):
                seq = engine.new_sequence(ids, SamplingParams(max_tokens=n, ignore_eos=True))
                reqs.append(engine.submit(seq, lambda kind, _p: kind in ("done", "error") and done.release()))
        assert done.acquire(timeout=120)  # the shortest one has finished and left; two more join mid-flight
        for ids, n in zip(prompts[4:], lengths[4:]):
            seq = engine.new_sequence(ids, SamplingParams(max_tokens=n, ignore_eos=True))
            reqs.append(engine.submit(seq, lambda kind, _p: kind in ("done", "error") and done.release()))
        for _ in range(len(prompts) - 1):
            assert done.acquire(timeout=120)
        engine.close()
        for ids, n, req in zip(prompts, lengths, reqs):
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
    done = threading.Semaphore(0)
    reqs = []
    with single_thread():
        with engine._cv:
            for ids in prompts:
                seq = engine.new_sequence(ids, SamplingParams(max_tokens=16, ignore_eos=True))
                reqs.append(engine.submit(seq, lambda kind, _p: kind in ("done", "error") and done.release()))
        for _ in prompts:
            assert done.acquire(timeout=120)
        engine.close()
        for ids, req in zip(prompts, reqs):
            assert req.seq.output_ids() == generate(model, ids, SamplingParams(max_tokens=16, ignore_eos=True)).output_ids()
    assert sum(r.seq.metrics.spec_steps for r in reqs) > 0
