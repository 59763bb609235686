"""bench/gguf.py's uncertainty: per-chunk NLL recovered from llama-perplexity's running perplexities, and the
paired bootstrap ratio of two files scored on the same chunks, checked against direct computation."""
import math
import random

from bench.score import paired_ratio


def _module():
    from bench import gguf

    return gguf


def test_chunk_nll_inverts_the_running_perplexity():
    g = _module()
    rng = random.Random(1)
    nll = [rng.uniform(2.0, 4.0) for _ in range(11)]
    running = [math.exp(sum(nll[:k + 1]) / (k + 1)) for k in range(len(nll))]
    got = g.chunk_nll([float(f"{p:.4f}") for p in running])  # as llama-perplexity prints them: 4 decimals
    assert max(abs(a - b) for a, b in zip(got, nll)) < 0.02


def test_paired_ratio_is_the_perplexity_ratio_and_its_interval_follows_the_spread():
    g = _module()
    rng = random.Random(2)
    b = [rng.uniform(2.0, 4.0) for _ in range(40)]
    shifted = [x + 0.01 for x in b]  # every chunk 1% worse: no spread in the difference
    r, lo, hi = paired_ratio(shifted, b)
    assert abs(r - math.exp(0.01)) < 1e-12 and abs(lo - r) < 1e-12 and abs(hi - r) < 1e-12
    noisy = [x + (0.05 if i % 2 else -0.05) for i, x in enumerate(b)]  # differences of mean 0, spread 0.05
    r, lo, hi = paired_ratio(noisy, b)
    assert abs(r - 1) < 1e-12 and lo < 1 < hi
    # the 95% interval of a mean of 40 such differences: about 2 x 1.96 x 0.05 / sqrt(40) = 0.031 wide in log
    assert 0.022 < math.log(hi) - math.log(lo) < 0.040, (lo, hi)
