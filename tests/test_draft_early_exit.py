"""`--draft early-exit:N`: the target's first N layers as a draft; output exactly the target's."""
import pytest
import torch

from helpers import sampled_pair_frequencies
from quantkit.drafts import drafter_factory
from quantkit.drafts.early_exit import early_exit_draft
from quantkit.errors import UserError
from quantkit.runtime.generate import generate
from quantkit.runtime.sampling import SamplingParams
from quantkit.testing.models import single_thread, tiny_llama


def _prompts(n, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (int(torch.randint(3, 10, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def test_draft_is_the_first_layers_then_norm_and_head_in_float64():
    model = tiny_llama(vocab_size=128, layers=4, seed=4, dtype=torch.float64, init_std=0.2)
    draft = early_exit_draft(model, 2)
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        h = model.model(ids, output_hidden_states=True).hidden_states[2]  # after layer index 1
        want = model.lm_head(model.model.norm(h))
        got = draft(ids).logits
        full = model(ids).logits
    assert (got - want).abs().max() < 1e-12
    assert (got - full).abs().max() > 1e-3  # two layers fewer do change the logits
    # shared tensors, not copies; the target itself keeps all its layers
    assert draft.model.layers[0].mlp.down_proj.weight is model.model.layers[0].mlp.down_proj.weight
    assert draft.lm_head is model.lm_head and len(model.model.layers) == 4
    assert model.config.num_hidden_layers == 4 and draft.config.num_hidden_layers == 2


def test_greedy_with_early_exit_equals_plain_on_50_prompts():
    model = tiny_llama(vocab_size=256, layers=4, seed=5, init_std=0.1)
    make = drafter_factory(model, None, draft="early-exit:2")
    steps = accepted = 0
    with single_thread():
        for prompt in _prompts(50, 256, seed=1):
            plain = generate(model, prompt, SamplingParams(max_tokens=12)).output_ids()
            seq = generate(model, prompt, SamplingParams(max_tokens=12), drafter=make(), cost_aware=False)
            assert seq.output_ids() == plain, prompt
            steps += seq.metrics.spec_steps
            accepted += seq.metrics.accepted
    assert steps > 100 and accepted > 0  # drafts were made and checked, some kept


def test_sampled_sequences_with_early_exit_follow_the_target():
    # As tests/test_speculative.py's end-to-end test: tokens 2 and 3 come from verify steps; their joint law,
    # exact by enumeration, is what the sampler must reproduce.
    V = 4
    target = tiny_llama(vocab_size=V, hidden=16, layers=3, seed=23, init_std=0.8)
    draft = early_exit_draft(target, 1)
    prompt = [1, 2, 3]

    def law(model):
        with torch.inference_mode():
            seqs = torch.tensor([prompt + [a, b, c] for a in range(V) for b in range(V) for c in range(V)])
            pr = model(seqs).logits[:, -4:-1].softmax(-1)
        a, b, c = seqs[:, 3], seqs[:, 4], seqs[:, 5]
        i = torch.arange(len(seqs))
        joint = pr[i, 0, a] * pr[i, 1, b] * pr[i, 2, c]
        return torch.zeros(V * V).index_add_(0, b * V + c, joint)

    def tv(a, b):
        return 0.5 * (a - b).abs().sum().item()

    exact, draft_law = law(target), law(draft)
    assert tv(exact, draft_law) > 0.15  # the draft must be clearly wrong for the test to mean anything
    emp = sampled_pair_frequencies(target, draft, prompt, V)
    # 800 draws on 16 outcomes: an exact sampler's TV stays under ~0.06 (tests/test_speculative.py)
    assert tv(emp, exact) < 0.09
    assert tv(emp, draft_law) > tv(emp, exact) + 0.07


@pytest.mark.parametrize("spec", ["early-exit:0", "early-exit:4", "early-exit:x", "early-exit:"])
def test_bad_layer_counts_are_refused(spec):
    with pytest.raises(UserError, match="early-exit"):
        drafter_factory(tiny_llama(layers=4), None, draft=spec)
