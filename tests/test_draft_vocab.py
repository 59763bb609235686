"""A draft head with a reduced vocabulary: the chosen ids, the gathered output rows, training, exact drafting."""
import json

import pytest
import torch
from safetensors.torch import load_file

from quantkit.drafts import drafter_factory
from quantkit.drafts.draft_vocab import choose_vocab, from_d2t, spread, to_d2t
from quantkit.drafts.eagle_head import load_head, new_head
from quantkit.runtime.generate import generate
from quantkit.runtime.sampling import SamplingParams
from quantkit.testing.models import single_thread
from test_draft_eagle import V, _own_text, target, train_on_own_text  # noqa: F401 (target: a fixture)

N = 40  # of V = 64 tokens


@pytest.fixture(scope="module")
def trained(target, tmp_path_factory):
    return train_on_own_text(target, tmp_path_factory.mktemp("head_sub"), vocab=N)


def test_choose_vocab_ranks_text_and_target_choices_then_fills_by_id():
    text = torch.tensor([[5, 5, 5, 9, 9, 7]])
    top1 = torch.tensor([[9, 9, 3, 3, 3, 3]])  # 9: 2+2, 3: 4, 5: 3, 7: 1
    assert choose_vocab(text, top1, 3, 12).tolist() == [3, 5, 9]
    assert choose_vocab(text, None, 2, 12).tolist() == [5, 9]
    # four used tokens (3, 5, 7, 9); the other three slots go to the lowest unused ids (a BPE's merge order)
    assert choose_vocab(text, top1, 7, 12).tolist() == [0, 1, 2, 3, 5, 7, 9]
    ids = torch.tensor([0, 3, 4, 60])
    assert from_d2t(to_d2t(ids)).tolist() == ids.tolist()
    with pytest.raises(ValueError):
        choose_vocab(text, None, 12, 12)


def test_reduced_output_equals_the_full_product_on_its_ids_float64(target):
    """The gathered-row logits equal the full output product restricted to the head's ids (float64 reference,
    float32 compute: within 1e-5 of the largest logit) and are -inf elsewhere, so q is 0 outside."""
    g = torch.Generator().manual_seed(4)
    ids = torch.sort(torch.randperm(V, generator=g)[:N]).values
    head = new_head(target, seed=1, vocab_ids=ids).attach_output(target)
    feats = torch.randn(3, 32, generator=g)
    got = head.draft_logits(feats)
    ref = feats.double() @ target.lm_head.weight.double().T
    assert got.shape == (3, V)
    scale = ref.abs().max()
    assert ((got[:, ids].double() - ref[:, ids]).abs().max() <= 1e-5 * scale)
    outside = torch.ones(V, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(got[:, outside]).all()
    q = got.softmax(-1)
    assert torch.allclose(q.sum(-1), torch.ones(3)) and (q[:, outside] == 0).all()
    assert torch.equal(spread(torch.tensor([1.0, 2.0]), torch.tensor([3, 0]), 4),
                       torch.tensor([2.0, float("-inf"), float("-inf"), 1.0]))


def test_training_a_reduced_head_saves_its_ids_and_learns(trained, target):
    out, result = trained
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["draft_vocab_size"] == N == result["draft_vocab"] and cfg["vocab_size"] == V
    state = load_file(str(out / "model.safetensors"))
    assert state["d2t"].dtype == torch.int64 and state["d2t"].shape == (N,)
    head = load_head(out, target)
    ids = head.vocab_ids
    assert torch.equal(ids, from_d2t(state["d2t"])) and bool((ids[1:] > ids[:-1]).all())
    assert head.out_w.shape == (N, 32) and torch.equal(head.out_w, target.lm_head.weight[ids])
    hist = result["history"]
    assert result["best_loss"] < 0.75 * hist[0]["heldout_loss"]
    assert max(h["heldout_top1"] for h in hist) > hist[0]["heldout_top1"] + 0.1


def test_greedy_with_a_reduced_head_equals_plain_on_50_prompts(target, trained):
    make = drafter_factory(target, None, draft=str(trained[0]))
    ids = set(load_head(trained[0], target).vocab_ids.tolist())
    drafted, accepted, steps = [], 0, 0
    with single_thread():
        for i, sample in enumerate(_own_text(target, 50, 5)):
            prompt = sample.tolist()[: 4 + i % 8]
            plain = generate(target, prompt, SamplingParams(max_tokens=12)).output_ids()
            drafter = make()
            propose = drafter.propose
            drafter.propose = lambda *a, **k: (r := propose(*a, **k), drafted.extend(r[0]))[0]
            seq = generate(target, prompt, SamplingParams(max_tokens=12), drafter=drafter, cost_aware=False)
            assert seq.output_ids() == plain, i
            accepted, steps = accepted + seq.metrics.accepted, steps + seq.metrics.spec_steps
    # kept drafts per step: ~0.18 for this head, ~0.17 for the full-vocabulary head trained the same way, ~0.02
    # for an untrained head (measured once on these seeds)
    assert steps > 200 and accepted > 0.1 * steps
    assert set(drafted) <= ids  # never a token outside its vocabulary


def test_load_refuses_a_corrupt_vocabulary(trained, target, tmp_path):
    from safetensors.torch import save_file

    from quantkit.errors import UserError

    out, _ = trained
    state = load_file(str(out / "model.safetensors"))
    state["d2t"] = to_d2t(torch.tensor(list(range(N - 1)) + [V + 5]))  # an id past the target's vocabulary
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((out / "config.json").read_text())
    with pytest.raises(UserError, match="d2t"):
        load_head(tmp_path, target)
