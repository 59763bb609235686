"""Speculative decoding: greedy output unchanged, identical draft fully accepted, sampled output ~ target."""
import pytest
import torch

from helpers import rel_err, sampled_pair_frequencies
from quantkit.errors import UserError
from quantkit.runtime.generate import generate
from quantkit.runtime.sequence import Sequence
from quantkit.runtime.sampling import SamplingParams
from quantkit.drafts import self_w4_draft
from quantkit.drafts.model_draft import ModelDrafter, check_vocab
from quantkit.drafts.prompt_lookup import PromptLookupDrafter
from quantkit.runtime.speculative import accept
from quantkit.testing.models import tiny_llama


def _repetitive_prompts(n, vocab, seed=2):
    # A random chunk repeated with edits: what code editing looks like, so prompt lookup has matches to use.
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        chunk = torch.randint(1, vocab, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g)
        reps = [chunk, torch.randint(1, vocab, (2,), generator=g), chunk, chunk[: len(chunk) // 2]]
        out.append(torch.cat(reps).tolist())
    return out


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab_size=256, seed=11)


def test_greedy_with_speculation_equals_without_on_50_prompts(model):
    draft = self_w4_draft(model, group_size=32)
    prompts = _repetitive_prompts(50, 256)
    lookup_steps = model_steps = 0
    for i, prompt in enumerate(prompts):
        plain = generate(model, prompt, SamplingParams(max_tokens=12)).output_ids()
        # Alternate the draft source so both are covered without doubling the test's time.
        drafter = PromptLookupDrafter(3) if i % 2 else ModelDrafter(draft)
        # cost_aware off: every step that can draft does (a same-size draft is slower than plain decoding on a CPU)
        seq = Sequence(model, prompt, SamplingParams(max_tokens=12), drafter=drafter, num_speculative_tokens=4,
                       cost_aware=False)
        while not seq.done:
            seq.step()
            if not seq.done:  # both caches rolled back to the context minus the pending last token
                assert seq.cache.get_seq_length() == seq.ids.shape[0] - 1
                assert getattr(drafter, "n_cached", 0) <= seq.ids.shape[0]
        assert seq.output_ids() == plain, i
        if i % 2:
            lookup_steps += seq.metrics.spec_steps
        else:
            model_steps += seq.metrics.spec_steps
    # The comparison only means something if drafts were actually checked (and some refused).
    assert lookup_steps > 20 and model_steps > 20


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_identical_draft_accepts_everything(model, temperature):
    k = 4
    # 1 prefill token + 5 full verify steps of k+1: every step drafts the full k (the rule alone: no timed
    # pauses, which a same-size draft on a CPU would earn and which tests/test_spec_governor.py covers)
    params = SamplingParams(max_tokens=1 + 5 * (k + 1), temperature=temperature, seed=5)
    seq = generate(model, [4, 8, 15, 16, 23, 42], params, drafter=ModelDrafter(model), num_speculative_tokens=k,
                   cost_aware=False)
    m = seq.metrics
    assert m.acceptance_rate == 1.0 and m.mean_accepted_length == k + 1
    assert m.target_forwards == 6 and m.output_tokens == 26


def _tv(a, b):
    return 0.5 * (a - b).abs().sum().item()


def test_accept_rule_output_follows_target_distribution():
    g = torch.Generator().manual_seed(0)
    V = 6
    p = torch.softmax(torch.randn(2, V, generator=g) * 1.5, -1)  # row 0: draft position, row 1: bonus
    q = torch.softmax(torch.randn(1, V, generator=g) * 1.5, -1)
    assert _tv(p[0], q[0]) > 0.2  # the draft must be clearly wrong for the test to mean anything
    counts, tvs = torch.zeros(V), {}
    n_total = 0
    for n in (500, 4500, 35000):
        drafts = torch.multinomial(q[0], n, replacement=True, generator=g).tolist()
        for t in drafts:
            kept, extra = accept(p, q, [t], g, greedy=False)
            counts[t if kept else extra] += 1
        n_total += n
        emp = counts / n_total
        tvs[n_total] = (_tv(emp, p[0]), _tv(emp, q[0]))
    sizes = sorted(tvs)
    # Sampling error of an empirical distribution on V=6 shrinks like sqrt(V/N): ~0.11 at 500, ~0.013 at 40000.
    assert tvs[sizes[-1]][0] < 0.02
    assert tvs[sizes[-1]][0] < tvs[sizes[0]][0]
    assert all(d_q > 0.15 for _, d_q in tvs.values())


def test_accept_rule_with_deterministic_draft():
    # A prompt-lookup draft is a point mass: token t survives with probability p(t), else p without t.
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(2, 5, generator=g), -1)
    counts = torch.zeros(5)
    for _ in range(20000):
        kept, extra = accept(p, None, [2], g, greedy=False)
        counts[2 if kept else extra] += 1
    # 20000 draws on 5 outcomes: 3 standard errors of TV stay under 0.02.
    assert _tv(counts / counts.sum(), p[0]) < 0.02


def test_sequences_with_speculation_follow_target_distribution():
    # End to end on a 4-token vocabulary. The first token comes from the prefill; tokens 2 and 3 come from
    # verify steps (k=2, or k=1 after an early refusal), so their joint law, exact by enumerating every
    # continuation, is what is checked.
    V = 4
    target = tiny_llama(vocab_size=V, hidden=16, layers=1, seed=21, init_std=0.8)
    draft = tiny_llama(vocab_size=V, hidden=16, layers=1, seed=22, init_std=0.8)
    prompt = [1, 2, 3]

    def law(model):
        with torch.inference_mode():
            seqs = torch.tensor([prompt + [a, b, c] for a in range(V) for b in range(V) for c in range(V)])
            pr = model(seqs).logits[:, -4:-1].softmax(-1)  # next-token laws after prompt, +a, +a+b
        a, b, c = seqs[:, 3], seqs[:, 4], seqs[:, 5]
        i = torch.arange(len(seqs))
        joint = pr[i, 0, a] * pr[i, 1, b] * pr[i, 2, c]
        return torch.zeros(V * V).index_add_(0, b * V + c, joint.double().float())

    exact, draft_law = law(target), law(draft)
    assert _tv(exact, draft_law) > 0.2  # the draft must be clearly wrong for the test to mean anything
    emp = sampled_pair_frequencies(target, draft, prompt, V)
    # An exact sampler's TV on 16 outcomes after 800 draws is about 0.4*sum(sqrt(p))/sqrt(800) <= 0.06.
    assert _tv(emp, exact) < 0.09
    assert _tv(emp, draft_law) > _tv(emp, exact) + 0.1


def test_prompt_lookup_proposes_what_followed_the_last_ngram():
    d = PromptLookupDrafter(3)
    ids = torch.tensor([5, 6, 7, 8, 9, 1, 2, 6, 7])
    draft, q = d.propose(ids, 3, SamplingParams(), None)
    assert draft == [8, 9, 1] and q is None
    # the longest n-gram wins over a shorter one that occurs later
    assert d.propose(torch.tensor([1, 2, 3, 4, 9, 3, 5, 2, 3]), 2, SamplingParams(), None)[0] == [4, 9]
    # of two occurrences the earliest with k tokens after it wins (the source being copied, not the copy)...
    ids = torch.tensor([4, 5, 6, 7, 8, 9, 0, 4, 5, 6, 3, 4, 5])
    assert d.propose(ids, 3, SamplingParams(), None)[0] == [6, 7, 8]
    # ...and where none has k after it, the latest occurrence gives what it has
    assert d.propose(torch.tensor([7, 1, 2, 8, 1, 2]), 3, SamplingParams(), None)[0] == [8, 1, 2]
    assert d.propose(torch.tensor([1, 2, 9, 1, 2]), 3, SamplingParams(), None)[0] == [9, 1, 2]
    assert d.propose(torch.tensor([9, 1, 2, 1, 2]), 3, SamplingParams(), None)[0] == [1, 2]
    # a lone matching token drafts nothing unless one-token matches are asked for (or the maximum is 1)
    ids = torch.tensor([4, 8, 9, 3, 5, 4])
    assert d.propose(ids, 2, SamplingParams(), None)[0] == []
    assert PromptLookupDrafter(3, min_ngram=1).propose(ids, 2, SamplingParams(), None)[0] == [8, 9]
    assert PromptLookupDrafter(1).propose(ids, 2, SamplingParams(), None)[0] == [8, 9]
    assert d.propose(torch.tensor([1, 2, 3, 4]), 3, SamplingParams(), None)[0] == []
    with pytest.raises(UserError):
        PromptLookupDrafter(0)


def test_prompt_lookup_drafts_long_only_after_a_long_match():
    """Drafts beyond SHORT_DRAFT tokens are earned by the length of the match before the occurrence: two tokens
    of context per drafted pair (per_matched=2), so a text being copied gets the whole k and a coincidental
    3-gram gets SHORT_DRAFT."""
    g = torch.Generator().manual_seed(3)
    source = torch.randint(10, 100, (40,), generator=g)
    d = PromptLookupDrafter(3)
    assert d.SHORT_DRAFT == 4
    for copied, want in ((2, 4), (3, 6), (4, 8), (5, 10), (6, 12), (20, 12)):
        # the source, something else (tokens absent from it), then its first `copied` tokens again
        ids = torch.cat([source, torch.tensor([1, 2, 3]), source[:copied]])
        draft = d.propose(ids, 12, SamplingParams(), None)[0]
        assert draft == source[copied: copied + want].tolist(), copied
    # an odd k: 4 matched tokens earn 8, capped at k=7 (a match of ceil(7/2) must be looked for, not 3)
    ids = torch.cat([source, torch.tensor([1, 2, 3]), source[:4]])
    assert d.propose(ids, 7, SamplingParams(), None)[0] == source[4:11].tolist()
    # the match is the run of equal tokens back from the occurrence; equal tokens past a mismatch do not count
    text = torch.tensor([50, 60, 70, 11, 12, 13]).tolist() + source.tolist() + [50, 60, 99, 11, 12, 13]
    assert d.propose(torch.tensor(text), 12, SamplingParams(), None)[0] == source[:6].tolist()
    ids = torch.cat([source, torch.tensor([1, 2, 3]), source[:2]])
    assert d.propose(ids, 3, SamplingParams(), None)[0] == source[2:5].tolist()  # k <= SHORT_DRAFT: untouched
    assert PromptLookupDrafter(3, per_matched=0).propose(ids, 12, SamplingParams(), None)[0] == source[2:14].tolist()
    # a match running back to the start of the text counts what there is: 4 tokens earn 8
    ids = torch.cat([source[:4], torch.tensor([1, 2]), source[:4]])
    assert d.propose(ids, 12, SamplingParams(), None)[0] == [1, 2] + source[:4].tolist()
    ids = torch.cat([source[:4], torch.tensor([1, 2]), source, torch.tensor([3]), source[:4]])
    assert d.propose(ids, 12, SamplingParams(), None)[0] == [1, 2] + source[:6].tolist()


def test_vocabulary_mismatch_is_refused():
    with pytest.raises(UserError, match="vocabulary"):
        check_vocab(tiny_llama(vocab_size=256), tiny_llama(vocab_size=300))


def test_self_w4_draft_is_a_quantised_copy(model):
    draft = self_w4_draft(model, group_size=32)
    w = model.model.layers[0].mlp.down_proj.weight
    wq = draft.model.layers[0].mlp.down_proj.weight
    assert not torch.equal(w, wq)
    # 4-bit symmetric: 15 distinct levels per group of 32 (scale * -8..7), error at most half a step.
    groups = wq.reshape(wq.shape[0], -1, 32)
    assert max(len(torch.unique(gr)) for gr in groups.reshape(-1, 32)) <= 16
    step = w.reshape(w.shape[0], -1, 32).abs().amax(-1, keepdim=True) / 7
    assert ((groups - w.reshape_as(groups)).abs() <= step / 2 + 1e-6).all()
    assert torch.equal(draft.lm_head.weight, model.lm_head.weight)
    assert ModelDrafter(draft).deterministic is False


def test_packed_self_w4_draft_holds_the_same_codes_and_keeps_output_exact(model):
    """`--draft self-w4` on a CPU: packed int4 modules with exactly the fake-quant copy's weights; drafts from
    them (bf16 activations) may differ, the target's greedy output may not."""
    from quantkit.linear.quant import QuantLinear

    fake = self_w4_draft(model, group_size=32)
    packed = self_w4_draft(model, group_size=32, packed=True)
    mods = dict(packed.named_modules())
    n_quant = 0
    for name, m in fake.named_modules():
        if isinstance(m, torch.nn.Linear) and m is not fake.lm_head:
            assert isinstance(mods[name], QuantLinear)
            assert torch.equal(mods[name].dequantized_weight().float(), m.weight.float()), name
            n_quant += 1
    assert n_quant == 2 * 7
    ids = torch.tensor([_repetitive_prompts(1, 256, seed=5)[0]])
    with torch.no_grad():
        a, b = packed(ids).logits, fake(ids).logits
    # bf16 activations (8 mantissa bits) through two layers and a float16 head: ~1e-2 relative, while a
    # wrong packing would be order 1
    assert 0 < rel_err(a, b) < 3e-2
    for prompt in _repetitive_prompts(6, 256, seed=6):
        plain = generate(model, prompt, SamplingParams(max_tokens=12)).output_ids()
        seq = generate(model, prompt, SamplingParams(max_tokens=12), drafter=ModelDrafter(packed),
                       num_speculative_tokens=4)
        assert seq.output_ids() == plain and seq.metrics.spec_steps > 0
