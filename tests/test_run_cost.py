"""quantkit/evaluate/run_cost.py, the run-time and peak-memory model `quantkit estimate` prints, against the
pipeline itself: the Linears it deals to ranks and the bytes its all-reduce moves, the way its GPTQ time grows
with a Linear's shape and with tokens, the time of a whole tiny run predicted from its parts' timings, and the
peak RSS of a real quantize run."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from unittest import mock

import pytest
import torch

from quantkit import distributed
from quantkit.evaluate import run_cost
from quantkit.evaluate.estimate import shape_from_config
from quantkit.schemes import get_scheme
from quantkit.solvers.gptq_solver import GPTQSolver

# A llama small enough to run in seconds, large enough that its tensors, not Python's, set the peak and the time
CFG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 768,
       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
       "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "float32"}
CONSTANTS = {"forward_s": 1e-10, "hessian_s": 2e-11, "solve_s": 3e-10, "column_s": 1e-4, "rtn_s": 1e-9, "load_s": 0.0}


def _tiny_model(seed: int = 0):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(LlamaConfig(**CFG), dtype=torch.float32).eval()


def _solver(out: int, inp: int, tokens: int = 0, holdout: int = 0) -> GPTQSolver:
    from dataclasses import replace

    torch.manual_seed(0)
    s = GPTQSolver("x", torch.randn(out, inp), replace(get_scheme("w4a16"), group_size=32))
    if tokens:
        s.add_batch(torch.randn(tokens, inp))
    if holdout:
        s.add_holdout(torch.randn(holdout, inp))
    return s


def _best(fn, reps: int = 3) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def test_two_ranks_halve_calibration_and_wait_for_the_ranks_the_pipeline_deals():
    from quantkit.pipeline.sequential import _cost

    shape = shape_from_config(CFG)
    one = run_cost.layer_time(shape, "gptq", 64, 128, 1, CONSTANTS, 1e9)
    two = run_cost.layer_time(shape, "gptq", 64, 128, 2, CONSTANTS, 1e9)
    assert two["calibration"] == pytest.approx(one["calibration"] / 2, rel=1e-12)
    # the costs the pipeline deals by, for the same Linears as real solvers
    lins = run_cost.layer_linears(shape)
    assert run_cost.solve_costs(shape, "gptq") == [_cost(_solver(x.out, x.inp)) for x in lins]
    # the pipeline deals each stage (q/k/v, o, gate/up, down) on its own, as a 2-rank run deals
    expected = 0.0
    for k in sorted({x.stage for x in lins}):
        stage = [x for x in lins if x.stage == k]
        with mock.patch.object(distributed, "world", return_value=2):
            ranks = distributed.owners([_cost(_solver(x.out, x.inp)) for x in stage])
        secs = [CONSTANTS["solve_s"] * x.inp ** 2 * x.out + CONSTANTS["column_s"] * x.inp for x in stage]
        expected += max(sum(t for t, r in zip(secs, ranks) if r == k) for k in (0, 1))
    one_rank = sum(CONSTANTS["solve_s"] * x.inp ** 2 * x.out + CONSTANTS["column_s"] * x.inp for x in lins)
    assert two["solve"] == pytest.approx(expected, rel=1e-12)
    assert one["solve"] == pytest.approx(one_rank, rel=1e-12)
    assert one_rank / 2 < two["solve"] < one_rank  # o and down are stages of one Linear: no rank shares them
    assert one["allreduce"] == one["broadcast"] == 0.0 and two["allreduce"] > 0 and two["broadcast"] > 0


def test_the_all_reduce_carries_the_bytes_the_model_counts():
    """GPTQSolver.reduce hands the pool its Hessian and held-out Hessian sums; the model counts 8 in^2 bytes each and
    a ring moves 2(N-1)/N of them over the link."""
    sent = []

    class Pool:
        @staticmethod
        def sum(t):
            sent.append(t.numel() * t.element_size())
            return t

        @staticmethod
        def count(n):
            return n

        total = count

    shape = shape_from_config(CFG)
    for lin in run_cost.layer_linears(shape):
        _solver(lin.out, lin.inp, tokens=8, holdout=8).reduce(Pool)
    hessians = sum(b for b in sent if b > 64)  # the token counts travel as scalars
    bandwidth, ranks = 1e9, 4
    t = run_cost.layer_time(shape, "gptq", 64, 128, ranks, {**CONSTANTS, "solve_s": 0.0}, bandwidth)
    calls = 2 * len(run_cost.layer_linears(shape))
    assert t["allreduce"] == pytest.approx(2 * (ranks - 1) / ranks * hessians / bandwidth
                                           + calls * run_cost.LATENCY_S, rel=1e-12)


def test_gptq_solve_time_is_in_squared_times_out_plus_a_step_per_column():
    """The two terms fitted on two shapes predict a third, wide rather than tall (out 1536, in 768)."""
    torch.set_num_threads(1)
    timed = [(o, i, _best(lambda: _solver(o, i, tokens=2048, holdout=256).solve(), reps=2))
             for o, i in ((384, 384), (768, 1536))]
    solve_s, column_s = run_cost.fit_solve(timed)
    o, i = 1536, 768
    measured = _best(lambda: _solver(o, i, tokens=2048, holdout=256).solve(), reps=2)
    predicted = run_cost.solve_seconds(run_cost.Linear(o, i, 0), "gptq", {"solve_s": solve_s, "column_s": column_s})
    assert predicted / 2 < measured < predicted * 2, (timed, measured, predicted)


def test_hessian_accumulation_grows_with_tokens():
    torch.set_num_threads(1)
    x = torch.randn(8192, 1024)
    s = _solver(16, 1024)
    t1 = _best(lambda: s.add_batch(x[:2048]))
    t4 = _best(lambda: s.add_batch(x))
    assert 4 / 2 < t4 / t1 < 4 * 2, (t1, t4)


def _timed_parts(model, shape, tokens: int) -> dict:
    """The model's constants fitted on this machine from one layer's forward, one Hessian's accumulation and
    one guarded GPTQ solve, timed apart from any pipeline."""
    layer = model.model.layers[0]
    h = torch.randn(1, tokens, shape.hidden)
    pos = torch.arange(tokens)[None]
    emb = model.model.rotary_emb(h, pos)
    with torch.no_grad():
        fwd = _best(lambda: layer(h, position_embeddings=emb, position_ids=pos))
    s = _solver(16, shape.intermediate)
    hess = _best(lambda: s.add_batch(torch.randn(tokens, shape.intermediate)))
    lin = run_cost.layer_linears(shape)[-1]
    solve = _best(lambda: _solver(lin.out, lin.inp, tokens=tokens, holdout=tokens // 8).solve())
    return {"forward_s": fwd / (tokens * run_cost.layer_params(shape)),
            "hessian_s": hess / (tokens * shape.intermediate ** 2),
            "solve_s": solve / (lin.inp ** 2 * lin.out), "column_s": 0.0, "rtn_s": 0.0, "load_s": 0.0}


def test_one_rank_time_of_a_tiny_run_is_what_its_parts_predict():
    from quantkit.pipeline.sequential import quantize_model
    from quantkit.plan import build_plan
    from quantkit.recipe.schema import Recipe

    torch.set_num_threads(1)
    shape = shape_from_config(CFG)
    samples, seq = 16, 128
    model = _tiny_model()
    consts = _timed_parts(model, shape, seq)
    predicted = shape.layers * run_cost.layer_time(shape, "gptq", samples, seq, 1, consts, 1e9)["total"]
    recipe = Recipe.model_validate({"quant": {"method": "gptq", "group_size": 32}})
    calib = [torch.randint(0, CFG["vocab_size"], (seq,)) for _ in range(samples)]
    measured = quantize_model(model, build_plan(model, recipe), calib).seconds
    assert predicted / 3 < measured < predicted * 3, (predicted, measured)


PEAK = """
import json, sys, torch
from pathlib import Path
torch.set_num_threads(1)
from quantkit.cli import main

def rss(key):
    return int(next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(key)).split()[1]) * 1024

ARGS = sys.argv[1:]

def quantize(model, out):
    sys.argv = ["quantkit", "quantize", model, "-o", out, *ARGS[3:]]
    try:
        main()
    except SystemExit as e:
        assert not e.code, e.code

quantize(ARGS[0], ARGS[2] + "/warm-out")  # every library the run imports, and the allocator's arenas, first
base = rss("VmRSS:")
Path("/proc/self/clear_refs").write_text("5")  # the high-water mark from here on
quantize(ARGS[1], ARGS[2] + "/big-out")
print(json.dumps({"base": base, "peak": rss("VmHWM:")}))
"""


def _save(cfg: dict, folder, tok):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**cfg), dtype=torch.float32).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def test_peak_memory_estimate_bounds_a_real_quantize(tmp_path):
    """After a warm-up run on a tiny model (libraries imported, allocator warmed), the RSS a quantize run adds
    is within a factor of 2 of the estimated peak."""
    from test_data_support import SAMPLE, tiny_tokenizer

    tok = tiny_tokenizer()
    vocab = max(CFG["vocab_size"], len(tok))
    warm = {**CFG, "vocab_size": vocab, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 1}
    big = {**CFG, "vocab_size": vocab, "hidden_size": 768, "intermediate_size": 2048}
    samples, seq = 16, 64
    p = subprocess.run([sys.executable, "-c", PEAK, _save(warm, tmp_path / "warm", tok), _save(big, tmp_path / "m", tok),
                        str(tmp_path), "--method", "gptq", "--scheme", "w4a16", "--calib", str(SAMPLE),
                        "--num-samples", str(samples), "--seq-len", str(seq), "-q"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    used = r["peak"] - r["base"]
    est = run_cost.peak_bytes(shape_from_config(big), "gptq", samples, seq, 1, dtype_bytes=4)
    # measured 1.84x and 2.05x the estimate without its "writing" part (2026-12-03; the second in CI); with it,
    # what is still not modelled is the allocator's slack; the stated factor is 2 either way
    assert est["total"] / 2 <= used <= 2 * est["total"], (used, est)


def test_a_cap_counts_spilled_activations_as_the_run_keeps_them():
    """Under --max-memory the estimate follows the run's own rule (capture/spill.py's Spill.decide on the same
    bytes): activations past it are counted one sample at a time in memory and the whole sets on disk."""
    from quantkit.capture.spill import Spill

    s = shape_from_config({**CFG, "hidden_size": 768, "intermediate_size": 2048})
    samples, seq, dtype_bytes = 64, 128, 2
    whole = 2 * samples * seq * s.hidden * dtype_bytes  # the two sets a layer holds: inputs and outputs
    free = run_cost.peak_bytes(s, "gptq", samples, seq, dtype_bytes=dtype_bytes)
    assert free["activations"] == whole and free["activations_on_disk"] == 0
    for cap in (whole, 8 * whole - 1, 8 * whole, 10 * whole):
        est = run_cost.peak_bytes(s, "gptq", samples, seq, dtype_bytes=dtype_bytes, cap=cap)
        spills = Spill(folder=None, cap=cap)
        spills.folder = "anywhere"  # decide() needs somewhere to spill to; nothing is written here
        if spills.decide(whole // 2):
            assert est["activations"] == 2 * seq * s.hidden * dtype_bytes and est["activations_on_disk"] == whole
            assert est["total"] == free["total"] - whole + est["activations"]
        else:
            assert est == free, cap
