"""Speculation backs off while drafts are rejected (so it is never much slower) and never changes the output."""
import torch

from quantkit.runtime.generate import Sequence, generate
from quantkit.runtime.sampling import SamplingParams
from quantkit.runtime.spec_governor import SpeculationGovernor
from quantkit.runtime.tiny import tiny_llama


class WrongDrafter:
    """Proposes tokens the target never picks (greedy): every verify step rejects the whole draft."""

    def __init__(self, model):
        self.model, self.calls = model, 0

    def propose(self, ids, k, params, generator):
        self.calls += 1
        with torch.no_grad():
            nxt = int(self.model(ids.unsqueeze(0)).logits[0, -1].argmax())
        return [(nxt + 1) % self.model.config.vocab_size] * k, None

    def rollback(self, valid_len):
        pass


def test_governor_pauses_and_recovers():
    g = SpeculationGovernor(min_rate=0.25, smoothing=0.5, first_pause=2, max_pause=8)
    allowed = []
    for _ in range(40):
        ok = g.allow()
        allowed.append(ok)
        if ok:
            g.update(0, 4)  # all rejected
    assert sum(allowed) <= 12  # pauses of 2, 4, 8, 8, ... between attempts
    while not g.allow():  # sit out the current pause
        pass
    g.update(4, 4)  # a fully accepted draft: back to the shortest pause, and drafting continues
    assert g.pause == 2 and g.allow()


def test_rejected_drafts_stop_being_proposed_and_output_is_unchanged():
    model = tiny_llama(vocab_size=256, seed=11)
    prompt = list(range(3, 20))
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    plain = generate(model, prompt, params)
    drafter = WrongDrafter(model)
    seq = Sequence(model, prompt, params, drafter=drafter, num_speculative_tokens=4)
    with torch.inference_mode():
        while not seq.done:
            seq.step()
    assert seq.output_ids() == plain.output_ids()
    assert seq.metrics.accepted == 0
    # without the governor every one of the ~60 steps would carry a 4-token draft
    assert drafter.calls < 15 and seq.metrics.target_forwards >= 60
