"""Speculation backs off while drafts are rejected (so it is never much slower) and never changes the output."""
import torch

from quantkit.runtime.generate import generate
from quantkit.runtime.sequence import Sequence
from quantkit.runtime.sampling import SamplingParams
from quantkit.runtime.spec_governor import SpeculationGovernor
from quantkit.testing.models import tiny_llama


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


def _run(g, steps, draft_step, plain_seconds=0.1):
    """Drive the governor for STEPS steps; draft_step(t) -> (accepted, drafted, seconds, draft_seconds).
    Returns the indices of the steps that drafted."""
    drafted = []
    for t in range(steps):
        if g.allow():
            drafted.append(t)
            g.update(*draft_step(t))
        else:
            g.plain_step(plain_seconds)  # one token
    return drafted


def _gaps(steps):
    return [b - a - 1 for a, b in zip(steps, steps[1:])]


def test_slow_drafting_is_retried_rarely_and_fast_drafting_resumes():
    """The promise (spec_governor.py): drafting steps slower per token than plain ones are paused long enough that
    a retry costs at most `overhead` of the decoding time between retries, up to `max_timed_pause`; and once
    drafting is faster again, it drafts (nearly) every step. Here a drafting step takes 1.0 s for 5 tokens, 0.5 s
    more than 5 plain steps of 0.1 s: at 5% overhead a retry needs 0.5 / (0.05 * 0.1) = 100 plain steps between."""
    slow = lambda t: (4, 4, 1.0, 0.6)
    g = SpeculationGovernor(first_pause=2, max_pause=8, probe_after=2, refresh=32, overhead=0.05,
                            max_timed_pause=1000)
    drafted = _run(g, 1000, slow)
    assert 3 <= len(drafted) <= 15  # it keeps retrying, but at most ~1000 / 100 times
    assert all(gap >= 100 for gap in _gaps(drafted)[3:])  # after the first comparisons: the overhead bound
    # the cap holds too: with max_timed_pause 40 no pause is longer than 40 steps, and none shorter once judged
    g = SpeculationGovernor(first_pause=2, max_pause=8, probe_after=2, refresh=32, overhead=0.05,
                            max_timed_pause=40)
    gaps = _gaps(_run(g, 400, slow))
    assert len(gaps) >= 5 and all(gap <= 40 for gap in gaps) and all(gap >= 40 for gap in gaps[3:])
    # the drafter becomes fast (0.3 s for 5 tokens: 0.06 s a token against 0.1 plain): drafting comes back
    drafted = _run(g, 600, lambda t: (4, 4, 0.3, 0.2))
    late = [t for t in drafted if t >= 400]
    assert len(late) >= 0.9 * 200, len(late)  # only the periodic plain probes (one per `refresh`) remain


def test_low_acceptance_turns_drafting_off_and_high_acceptance_back_on():
    """The accepted-fraction rule on its own (no timing): below min_rate drafting is mostly skipped, pauses never
    exceeding max_pause; with full acceptance every step drafts."""
    g = SpeculationGovernor(min_rate=0.25, smoothing=0.5, first_pause=2, max_pause=8)
    drafted = _run(g, 200, lambda t: (0, 4, None, 0.0))
    assert len(drafted) <= 200 / 8 + 4 and all(gap <= 8 for gap in _gaps(drafted))
    assert max(_gaps(drafted)) == 8  # pauses grow to max_pause on relapse
    drafted = _run(g, 100, lambda t: (4, 4, None, 0.0))
    assert len(drafted) >= 100 - 8 and drafted[-60:] == list(range(40, 100))  # back on, every step


def test_governor_keeps_drafting_that_is_faster_and_refreshes_the_plain_time():
    g = SpeculationGovernor(probe_after=2, refresh=8)
    plain = 0
    for _ in range(60):
        if g.allow():
            g.update(4, 4, seconds=0.3, draft_seconds=0.1)  # 0.06 s a token against 0.1 plain
        else:
            plain += 1
            g.plain_step(0.1)
    assert 1 <= plain <= 8  # the first probe, then one every 8 drafting steps
    assert g.spec_spt < g.plain_spt


def test_governor_does_not_probe_a_free_drafter_but_uses_its_plain_steps():
    """Prompt lookup drafts in no time: a forced plain step would only throw away a draft. Plain steps that
    happen anyway (no match found) still time the comparison, which stops drafts that cost more than they
    give back."""
    g = SpeculationGovernor(probe_after=2, refresh=8)
    for _ in range(40):
        assert g.allow()  # never paused: fully accepted, free, and nothing to compare with
        g.update(4, 4, seconds=0.3, draft_seconds=0.0)
    assert g.plain_spt is None
    g.plain_step(0.02)  # no match this step: a plain step of 0.02 s a token, against 0.06 drafting
    g.update(1, 4, seconds=0.3, draft_seconds=0.0)
    assert not g.allow()


class _Clock:
    """A fake clock for the decode loop: each reading moves it on by `tick`; a drafter may add its own cost."""

    def __init__(self, tick: float):
        self.t, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.t += self.tick
        return self.t


class ExactDrafter:
    """Proposes exactly the target's greedy continuation (so every draft is accepted), at a set cost in time."""

    def __init__(self, model, clock: _Clock, cost: float):
        self.model, self.clock, self.cost, self.calls = model, clock, cost, 0

    def propose(self, ids, k, params, generator):
        self.calls += 1
        self.clock.t += self.cost
        out, cur = [], ids
        with torch.no_grad():
            for _ in range(k):
                nxt = int(self.model(cur.unsqueeze(0)).logits[0, -1].argmax())
                out.append(nxt)
                cur = torch.cat([cur, torch.tensor([nxt])])
        return out, None

    def rollback(self, valid_len):
        pass


def test_accepted_but_costly_drafts_are_paused_and_cheap_ones_are_not(monkeypatch):
    """Every draft is accepted either way; only its (fake) cost differs. A draft that costs more than the tokens
    it saves is mostly skipped; a cheap one drafts nearly every step. The output never changes."""
    from quantkit.runtime import sequence as gen

    model = tiny_llama(vocab_size=256, seed=12)
    prompt = list(range(5, 25))
    params = SamplingParams(max_tokens=80, ignore_eos=True)
    plain = generate(model, prompt, params).output_ids()
    calls = {}
    for cost in (2.0, 0.0):  # per draft, against 0.1 s of clock per step (two readings of 0.05)
        clock = _Clock(0.05)
        monkeypatch.setattr(gen, "clock", clock)
        drafter = ExactDrafter(model, clock, cost)
        seq = generate(model, prompt, params, drafter=drafter, num_speculative_tokens=4)
        assert seq.output_ids() == plain
        assert seq.metrics.acceptance_rate == 1.0
        calls[cost] = drafter.calls
    assert calls[2.0] <= 8  # ~20 steps would have drafted without the timing
    assert calls[0.0] >= 14


def test_in_the_engine_each_request_is_timed_on_its_own_work(monkeypatch):
    """Requests share one forward per step; a request's step time must be its own draft plus the shared forward,
    not the wall time from its plan() to its finish(), which would include the other requests' drafting and make
    a plain step look as costly as a drafting one. Request A drafts alone for a few steps, then B joins; both
    drafters cost far more than they save and must be paused in both requests (24 drafts for A when each
    request was timed on the shared window)."""
    import threading

    from helpers import NumberTokenizer
    from quantkit.runtime import sequence as gen
    from quantkit.runtime.engine import Engine

    clock = _Clock(0.05)
    monkeypatch.setattr(gen, "clock", clock)
    model = tiny_llama(vocab_size=256, seed=12)
    params = SamplingParams(max_tokens=120, ignore_eos=True)
    drafters = []

    def factory():
        drafters.append(ExactDrafter(model, clock, 2.0))
        return drafters[-1]

    engine = Engine(model, NumberTokenizer(), drafter_factory=factory, spec_max_batch=8)
    finished = threading.Semaphore(0)
    b_started = threading.Event()

    def on_b(kind, _data):
        if kind in ("done", "error"):
            finished.release()

    def on_a(kind, data):
        if kind == "tokens" and not b_started.is_set() and req_a.seq.n_generated >= 6:
            b_started.set()
            engine.submit(engine.new_sequence(list(range(30, 50)), params), on_b)
        on_b(kind, data)

    req_a = engine.submit(engine.new_sequence(list(range(5, 25)), params), on_a)
    try:
        assert finished.acquire(timeout=120) and finished.acquire(timeout=120)
    finally:
        engine.close()
    assert b_started.is_set() and len(drafters) == 2
    assert [d.calls for d in drafters] == [min(d.calls, 8) for d in drafters], [d.calls for d in drafters]
    assert req_a.seq.governor.plain_spt < req_a.seq.governor.spec_spt
