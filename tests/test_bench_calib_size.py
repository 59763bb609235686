"""bench/calib_size.py's table (issue 43): each method's in-domain perplexity against the best method's on the same
windows, the other domains against RTN's, and the method `auto` picks marked, checked against direct arithmetic."""
import math

from transformers import LlamaConfig

from bench import calib_size


def _nll(base: float, step: float) -> list[float]:
    return [base + step * (i % 4) for i in range(16)]


def test_table_ratios_and_the_auto_mark():
    domains = list(calib_size.DOMAINS)
    flat = {d: _nll(2.0, 0.1) for d in domains}
    measured = {("float", "-", 0): {"window_nll": {d: _nll(1.5, 0.1) for d in domains}},
                ("rtn", "-", 0): {"window_nll": flat},
                ("awq", "code", 2048): {"window_nll": {d: [x - 0.05 for x in flat[d]] for d in domains}},
                ("awq+gptq", "code", 2048): {"window_nll": {d: [x - 0.10 for x in flat[d]] for d in domains}}}
    rows = {r["method"]: r for r in calib_size.table(measured, LlamaConfig())}
    assert set(rows) == {"awq", "awq+gptq (auto)"}
    awq = rows["awq"]
    assert awq["calibration"] == "code" and awq["tokens"] == 2048
    assert awq["in-domain ppl"] == round(math.exp(sum(flat["code"]) / 16 - 0.05), 3)
    # every window 0.05 nats above the best: the ratio and both ends of its interval are exp(0.05)
    want = f"{(math.exp(0.05) - 1) * 100:+.2f}%"
    assert awq["best in-domain"] == "awq+gptq"
    assert awq["vs best in-domain, 95%"] == f"{want} [{want[:-1]}, {want[:-1]}]"
    below = f"{(math.exp(-0.05) - 1) * 100:+.2f}%"
    assert awq["other domains vs rtn, 95%"].startswith(f"quotes {below}") and "manuals" in awq[
        "other domains vs rtn, 95%"] and "code " not in awq["other domains vs rtn, 95%"]
