"""Concurrent throughput: prompts of similar length share a prefill forward, and the slot cache's layout lets a
batched step's attention read its keys and values in place; answers stay what each request gets alone."""
from __future__ import annotations

import threading

import torch

from helpers import NumberTokenizer, run_together_as_alone
from quantkit.runtime import llama_step
from quantkit.runtime.engine import Engine, prefill_groups
from quantkit.runtime.generate import generate
from quantkit.runtime.kv_cache import new_decode_cache
from quantkit.runtime.sampling import SamplingParams
from quantkit.testing.models import single_thread, tiny_llama


def _check_groups(lengths, groups, max_tokens, max_pad):
    """The promises of prefill_groups (engine.py): every prompt in exactly one group; a shared group keeps its
    padded size (rows x longest) within max_tokens and within max_pad of its real tokens; groups hold prompts of
    neighbouring lengths; and a group is only closed when the next prompt by length could not join it."""
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))  # every prompt exactly once

    def fits(members):
        longest, real = max(lengths[i] for i in members), sum(lengths[i] for i in members)
        return len(members) * longest <= max_pad * real and len(members) * longest <= max_tokens

    for g in groups:
        assert len(g) == 1 or fits(g), [lengths[i] for i in g]
    spans = sorted((min(lengths[i] for i in g), max(lengths[i] for i in g)) for g in groups)
    for (_, hi), (lo, _) in zip(spans, spans[1:]):
        assert hi <= lo, spans  # no group's lengths reach into another's: similar prompts go together
    by_len = sorted(groups, key=lambda g: min(lengths[i] for i in g))
    for g, nxt in zip(by_len, by_len[1:]):
        shortest_next = min(nxt, key=lengths.__getitem__)
        assert not fits(g + [shortest_next]), "two groups that could have shared one forward"


def test_prefill_groups_keep_their_limits_on_random_lengths():
    gen = torch.Generator().manual_seed(0)
    for trial in range(300):
        n = int(torch.randint(0, 25, (1,), generator=gen))
        lengths = torch.randint(1, 3000, (n,), generator=gen).tolist()
        if trial % 3 == 0:  # clusters of near-equal lengths, as a burst of similar requests gives
            lengths = [100 + int(x) % 7 for x in lengths]
        max_tokens = int(torch.randint(16, 4096, (1,), generator=gen))
        max_pad = 1.0 + float(torch.rand(1, generator=gen))
        _check_groups(lengths, prefill_groups(lengths, max_tokens=max_tokens, max_pad=max_pad), max_tokens,
                      max_pad)
    lengths = [128, 5, 130, 127, 6, 40, 2000, 129, 3]
    groups = prefill_groups(lengths, max_tokens=600, max_pad=1.25)
    _check_groups(lengths, groups, 600, 1.25)
    assert [6] in groups  # longer than max_tokens: alone
    # equal prompts share forwards up to the token limit: 64 // 7 = 9 rows of 7 tokens each
    assert all(len(g) <= 9 for g in prefill_groups([7] * 20, max_tokens=64))
    assert len(prefill_groups([7] * 20, max_tokens=64)) == 3


def test_prompts_arriving_together_share_prefills_and_decode_as_alone(monkeypatch):
    from quantkit.runtime.engine import PREFILL_PAD, PREFILL_TOKENS

    model = tiny_llama(vocab_size=64, seed=11, init_std=0.2)
    g = torch.Generator().manual_seed(12)
    prompts = [torch.randint(1, 64, (n,), generator=g).tolist() for n in (20, 21, 19, 20, 3, 40, 22, 4)]
    prefills = []
    real = llama_step.forward_batch

    def counting(m, items, last):
        # the engine's worker only: the answers alone are decoded on this thread afterwards
        if threading.current_thread().name == "quantkit-decode" and any(ids.shape[0] > 1 and h.length == 0 for h, ids in items):
            prefills.append([int(ids.shape[0]) for _h, ids in items])
        return real(m, items, last)

    monkeypatch.setattr(llama_step, "forward_batch", counting)
    run_together_as_alone(Engine(model, NumberTokenizer(), max_active=16), model, prompts, 12)
    assert sorted(n for group in prefills for n in group) == sorted(len(p) for p in prompts)  # each prefilled once
    for group in prefills:  # shared forwards keep the engine's stated limits
        assert len(group) == 1 or len(group) * max(group) <= min(PREFILL_PAD * sum(group), PREFILL_TOKENS)
    # prompts of 19-22 tokens pad by at most 22/19 < 1.25: they arrived together, so at least some shared
    assert len(prefills) < len(prompts)


def test_a_step_reads_cached_keys_in_place():
    """Heads before positions in the pool: the rows a step attends over are a view of the storage, and a
    released slot's compaction moves the last row's keys into the hole without changing anyone's answer."""
    model = tiny_llama(vocab_size=64, seed=13, init_std=0.2)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = [[3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13, 14]]
    with single_thread(), torch.inference_mode():
        alone = [generate(model, p, params).output_ids() for p in prompts]
        caches = [new_decode_cache(model) for _ in prompts]
        outs = [[] for _ in prompts]
        feeds = [torch.tensor(p) for p in prompts]
        for step in range(6):
            if step == 2:  # the first sequence leaves: the third moves into its slot
                caches[0].release()
            live = [i for i in range(3) if not (step >= 2 and i == 0)]
            rows = llama_step.forward_batch(model, [(caches[i], feeds[i]) for i in live], True)
            for i, r in zip(live, rows):
                tok = int(r.all()[-1].argmax())
                outs[i].append(tok)
                feeds[i] = torch.tensor([tok])
        pool = llama_step.pool_for(model)
        head_dim = pool.head_dim
        assert pool.k[0].shape[1:] == (model.config.num_key_value_heads, pool.capacity, head_dim)
        k = pool.k[0][0:2, :, : pool.capacity // 2]
        flat = k.reshape(-1, k.shape[2], head_dim)  # the batched products' [rows*heads, positions, d]
        assert flat.untyped_storage().data_ptr() == pool.k[0].untyped_storage().data_ptr()  # a view: no copy
    assert outs[0][:2] == alone[0][:2]
    assert outs[1] == alone[1] and outs[2] == alone[2]
