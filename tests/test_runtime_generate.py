"""The decode loop: greedy equals transformers' generate, sampling follows its definition, limits hold."""
import pytest
import torch

from helpers import hf_greedy

from quantkit.errors import UserError
from quantkit.runtime.generate import generate
from quantkit.runtime.sequence import Sequence
from quantkit.runtime.sampling import SamplingParams, probs
from quantkit.testing.models import tiny_llama


def _prompts(n, vocab, seed=1, lo=3, hi=40):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def test_greedy_matches_transformers_generate_tiny():
    model = tiny_llama(vocab_size=512, seed=3)
    for prompt in _prompts(20, 512):
        ours = generate(model, prompt, SamplingParams(max_tokens=16)).output_ids()
        assert ours == hf_greedy(model, prompt, 16)


@pytest.mark.slow
def test_greedy_matches_transformers_generate_real_model():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantkit.models.embedded import embedded_model_dir

    path = embedded_model_dir()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # prose, code, numbers, a question, a letter: kinds of continuation the model handles differently
    texts = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,", "import numpy as np\n",
             "Q: What is 2+2?\nA:", "Dear Sir or Madam,", "SELECT * FROM", "Roses are red,"]
    for text in texts:
        ids = tok(text)["input_ids"]
        seq = generate(model, ids, SamplingParams(max_tokens=12, ignore_eos=True), eos=set())
        assert seq.output_ids() == hf_greedy(model, ids, 12), text


def _reference_probs(logits, temperature, top_k, top_p):
    # float64, one row at a time, written from the definitions rather than the implementation's masking.
    # Filters apply in transformers' order: temperature, then top-k, then top-p on what top-k kept.
    out = []
    for row in logits.double():
        z = row / temperature
        order = sorted(range(len(z)), key=lambda i: -z[i].item())
        keep = set(order[:top_k] if top_k else order)
        pz = torch.full_like(z, float("-inf"))
        pz[torch.tensor(sorted(keep))] = z[torch.tensor(sorted(keep))]
        pz = torch.softmax(pz, 0)
        mass, nucleus = 0.0, set()
        for i in order:
            if mass >= top_p:
                break
            nucleus.add(i)
            mass += pz[i].item()
        keep &= nucleus
        p = torch.zeros_like(z)
        idx = torch.tensor(sorted(keep))
        p[idx] = torch.softmax(z[idx], 0)
        out.append(p)
    return torch.stack(out)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 7, 0.6)])
def test_sampling_probs_match_float64_reference(temperature, top_k, top_p):
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 20, generator=g) * 2
    got = probs(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    # float32 softmax of O(1) logits: 1e-6 absolute leaves room for a few ulps of rounding.
    torch.testing.assert_close(got.double(), _reference_probs(logits, temperature, top_k, top_p), atol=1e-6, rtol=0)


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    model = tiny_llama(vocab_size=128, seed=4, init_std=0.3)
    prompt = [5, 9, 11, 3]
    a = generate(model, prompt, SamplingParams(max_tokens=30, temperature=1.0, seed=123)).output_ids()
    b = generate(model, prompt, SamplingParams(max_tokens=30, temperature=1.0, seed=123)).output_ids()
    c = generate(model, prompt, SamplingParams(max_tokens=30, temperature=1.0, seed=124)).output_ids()
    greedy = generate(model, prompt, SamplingParams(max_tokens=30)).output_ids()
    assert a == b
    assert a != c and a != greedy


def test_top_k_one_is_greedy():
    model = tiny_llama(vocab_size=128, seed=5, init_std=0.3)
    prompt = [1, 2, 3, 4, 5]
    sampled = generate(model, prompt, SamplingParams(max_tokens=20, temperature=1.5, top_k=1, seed=0)).output_ids()
    assert sampled == generate(model, prompt, SamplingParams(max_tokens=20)).output_ids()


def test_eos_stops_and_is_kept():
    model = tiny_llama(vocab_size=256, seed=6)
    prompt = [7, 8, 9, 10]
    free = generate(model, prompt, SamplingParams(max_tokens=20), eos=set()).output_ids()
    eos = free[4]
    first = free.index(eos)
    seq = generate(model, prompt, SamplingParams(max_tokens=20), eos={eos})
    assert seq.output_ids() == free[: first + 1] and seq.finish_reason == "stop"
    ignored = generate(model, prompt, SamplingParams(max_tokens=20, ignore_eos=True), eos={eos})
    assert ignored.output_ids() == free and ignored.finish_reason == "length"


def test_max_tokens_and_context_limits():
    model = tiny_llama(vocab_size=64, max_positions=32)
    seq = generate(model, list(range(1, 11)), SamplingParams(max_tokens=7))
    assert len(seq.output_ids()) == 7 and seq.finish_reason == "length"
    # The context caps generation: 30 prompt tokens leave room for 2 more.
    seq = generate(model, list(range(1, 31)), SamplingParams(max_tokens=100))
    assert len(seq.output_ids()) == 2
    with pytest.raises(UserError, match="context"):
        Sequence(model, list(range(1, 40)), SamplingParams())
    with pytest.raises(UserError, match="max_tokens"):
        Sequence(model, [1, 2], SamplingParams(max_tokens=0))
    with pytest.raises(UserError, match="top_p"):
        Sequence(model, [1, 2], SamplingParams(temperature=1.0, top_p=1.5))


def test_metrics_are_consistent():
    model = tiny_llama(vocab_size=128)
    seq = generate(model, [3, 4, 5], SamplingParams(max_tokens=10))
    m = seq.metrics.to_dict()
    assert m["output_tokens"] == 10 and m["target_forwards"] == 10 and m["tokens_per_target_forward"] == 1.0
    assert m["acceptance_rate"] is None and m["ttft_s"] > 0 and m["tpot_s"] > 0
    assert seq.cache.get_seq_length() == 3 + 10 - 1  # the last token is pending, not yet in the cache
