"""`torchrun -m quantkit quantize` on a real model (issue 39, requirement 2): SmolLM2-135M, 1 process against 2
gloo ranks, with the default W4 solvers (AWQ's searches and GPTQ's Hessians pooled over the ranks' samples).

Code for code equality is what the tiny model of tests/test_distributed.py checks. On SmolLM2 it cannot hold,
for a reason that has nothing to do with ranks: GPTQ carries every rounding along its row, so a float32
summation order anywhere upstream (the forward passes' GEMM blocking, the Hessian sums) moves a rounding and the
row follows; the next layer's AWQ then sees other inputs and can pick other scalings. Measured with this test's
arguments: one process with 2 threads against 1 thread changes 20% of layer 0's down_proj codes, the share 2
ranks change, and moves perplexity on 8 x 512 tokens of held-out prose by +0.29% (2 ranks: +0.35%; on another
run +0.03% and +0.03%; the quantisation itself costs 1.5%). Issue 39's 0.1% is inside that noise, so the bound
here is 0.5%, above the noise of thread count alone and a third of the quantisation's own cost.
Only the first two decoder layers are quantised, so the test takes seconds, not the minutes a
whole solve takes on two cores; every layer is still run, so later layers see the quantised first two."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from quantkit.data import load_eval_windows
from quantkit.evaluate.backends import score_quantkit
from quantkit.models.embedded import embedded_model_dir
from test_distributed import _alone, _torchrun

pytestmark = pytest.mark.slow
LATER_LAYERS = r"re:model\.layers\.([2-9]|[12][0-9])\..*"
ROOT = Path(__file__).resolve().parents[1]
CALIB, PROSE = ROOT / "calibration" / "texts" / "prose_calib.txt", ROOT / "bench" / "data" / "eval_prose.txt"


def _args(out) -> list[str]:
    # no MODEL: the embedded SmolLM2-135M
    return ["quantize", "-o", str(out), "--scheme", "w4a16", "--group-size", "64", "--method", "awq+gptq",
            "--calib", str(CALIB), "--num-samples", "20", "--seq-len", "128", "--ignore", "lm_head",
            "--ignore", LATER_LAYERS, "-q"]


def test_two_ranks_score_what_one_process_scores_on_smollm2(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    p = _alone(_args(one))
    assert p.returncode == 0, p.stderr[-2000:]
    p = _torchrun(_args(two))
    assert p.returncode == 0, p.stderr[-3000:]
    meta_one, meta_two = (json.loads((d / "quantkit.json").read_text()) for d in (one, two))
    assert (meta_one["processes"], meta_two["processes"]) == (1, 2)
    quantised = [n for n, layer in meta_one["layers"].items() if layer.get("scheme")]
    assert quantised and all(n.startswith(("model.layers.0.", "model.layers.1.")) for n in quantised), quantised
    windows = [list(w) for w in load_eval_windows(str(PROSE), AutoTokenizer.from_pretrained(embedded_model_dir()),
                                                  seq_len=512, max_windows=8)]
    ppl_float = score_quantkit(str(embedded_model_dir()), windows, [], 0, "float32").perplexity
    ppl_one = score_quantkit(str(one), windows, [], 0, "float32").perplexity
    ppl_two = score_quantkit(str(two), windows, [], 0, "float32").perplexity
    assert ppl_one > ppl_float * 1.002, (ppl_float, ppl_one)  # the two layers were quantised, visibly
    assert abs(math.log(ppl_two / ppl_one)) <= 5e-3, (ppl_float, ppl_one, ppl_two)
