"""The eval metrics on their own: KL against a float64 reference, percentiles, answer matching, gates."""
import numpy as np
import pytest
import torch

from quantkit.errors import UserError
from quantkit.evaluate import agreement as A
from quantkit.evaluate.gates import GATES, check_gates, parse_gates
from quantkit.evaluate.perplexity import scored_positions
from quantkit.evaluate.store import LogProbStore


def _kl64(p_logits, q_logits):
    lp, lq = p_logits.double().log_softmax(-1), q_logits.double().log_softmax(-1)
    return (lp.exp() * (lp - lq)).sum(-1)


def test_kl_matches_float64_reference_and_is_zero_against_itself():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(50, 300, generator=g) * 3
    b = a + torch.randn(50, 300, generator=g) * 0.5
    got = A.kl_per_token(a.log_softmax(-1), b.log_softmax(-1))
    # float32 log-softmax of O(10) logits is good to ~1e-6 per entry; summed over 300 entries with weights p
    # the error stays below 1e-5 absolute.
    torch.testing.assert_close(got.double(), _kl64(a, b), atol=1e-5, rtol=1e-4)
    assert (got > 0).all()
    assert A.kl_per_token(a.log_softmax(-1), a.log_softmax(-1)).abs().max() == 0


def test_top1_agreement():
    base = torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]]).log()
    var = torch.tensor([[0.2, 0.8], [0.4, 0.6], [0.1, 0.9]]).log()
    assert A.top1_agreement(base, var).tolist() == [True, False, True]


@pytest.mark.parametrize("q", [0, 50, 95, 99, 100])
def test_percentile_matches_numpy(q):
    v = np.random.default_rng(3).exponential(size=137)
    assert A.percentile(v.tolist(), q) == pytest.approx(float(np.percentile(v, q)), rel=1e-12)


def test_kl_stats():
    v = np.random.default_rng(4).exponential(size=1000)
    s = A.kl_stats(v.tolist())
    assert s["n"] == 1000 and s["max"] == pytest.approx(v.max())
    assert s["mean"] == pytest.approx(v.mean()) and s["p99"] == pytest.approx(np.percentile(v, 99))
    assert A.kl_stats([])["p99"] is None


@pytest.mark.parametrize("generated,ref,ok", [
    (" 579\n12 + 3 = 15", "579", True), (" 5790", "579", False), (" Paris. It is big", "Paris", True),
    ("\n\n  Berlin\n", "Berlin", True), (" paris", "Paris", False), (" np\nimport os", "np", True),
    (" [1, 2, 3]", "[1, 2, 3]", True), ("", "x", False), (" Parisian", "Paris", False),
])
def test_exact_match(generated, ref, ok):
    assert A.exact_match(generated, ref) is ok


def test_same_answer_compares_first_lines():
    assert A.same_answer(" 42\nmore", "42\nother")
    assert not A.same_answer(" 42", " 43")


def test_scored_positions_count_each_token_once():
    # Overlapping windows of 10 tokens (no prefix) with stride 4 over a 22-token stream: starts 0, 4, 8, 12.
    counts = [scored_positions(10, i, 4, 10) for i in range(4)]
    assert counts == [9, 4, 4, 4]
    assert sum(counts) == 22 - 1  # every token after the first predicted exactly once
    assert [scored_positions(10, i, 10, 10) for i in range(3)] == [9, 9, 9]


def test_logprob_store_round_trip(tmp_path):
    g = torch.Generator().manual_seed(5)
    s = LogProbStore(tmp_path)
    rows = {k: torch.randn(n, 17, generator=g).log_softmax(-1) for k, n in [("a", 3), ("b", 1), ("c", 6)]}
    for k, v in rows.items():
        s.put(k, v)
    for k, v in rows.items():
        assert torch.equal(s.get(k), v)
    s.close()
    assert not s.path.exists()


def _report(ppl=10.5, agree=0.95, kl99=0.3, tok=0.97):
    base = {"label": "base", "is_base": True, "ppl": 10.0, "all": {"answer_agreement": 1.0, "exact_match": 0.5},
            "kl": {"mean": 0.0, "p99": 0.0}, "token_agreement": 1.0}
    var = {"label": "w4", "is_base": False, "ppl": ppl, "all": {"answer_agreement": agree, "exact_match": 0.4},
           "kl": {"mean": 0.05, "p99": kl99}, "token_agreement": tok}
    return {"variants": [base, var]}


def test_gates_pass_and_fail():
    gates = {"max_ppl_increase": 0.06, "min_agreement": 0.9, "max_kl_p99": 0.5}
    assert check_gates(_report(), gates) == []
    fails = check_gates(_report(ppl=10.7, agree=0.8, kl99=0.6), gates)
    assert len(fails) == 3 and all(f.startswith("w4: ") for f in fails)
    assert any("max_ppl_increase = 0.07" in f for f in fails)
    # bounds are inclusive: a variant exactly at the bound passes
    assert check_gates(_report(tok=0.9), {"min_token_agreement": 0.9}) == []
    assert check_gates(_report(), {"min_exact_match": 0.45}) == ["w4: min_exact_match = 0.4 violates 0.45"]


def test_gate_on_unmeasured_metric_fails():
    r = _report()
    r["variants"][1]["ppl"] = None
    assert "cannot be checked" in check_gates(r, {"max_ppl_increase": 0.1})[0]


def test_parse_gates():
    assert parse_gates(["max_ppl_increase=0.02", "min_agreement=0.9"]) == {"max_ppl_increase": 0.02,
                                                                            "min_agreement": 0.9}
    with pytest.raises(UserError, match="valid gates: " + ", ".join(GATES)):
        parse_gates(["max_perplexity=3"])
    with pytest.raises(UserError, match="not a number"):
        parse_gates(["max_kl_p99=high"])
    with pytest.raises(UserError, match="NAME=VALUE"):
        parse_gates(["max_kl_p99"])
