"""Issue 39.5: the default (self-sampled calibration, `--method auto`) runs on SmolLM2 under a --max-memory cap
below its float model, holds at most the cap, and scores within 1% of the uncapped default.

SmolLM2-135M computes in float32 on a CPU: 538 MB of weights. Under cpu=448MiB the float model cannot sample, so
a round-to-nearest W8 copy built while the layers stream samples the calibration text (pipeline/sampling_copy.py),
the float layers stream again to be solved, and each layer's codes go to disk as they are solved
(formats/code_spool.py). The peak counted is anonymous memory above the imported process (tests/anon_peak.py says
why). The calibration is smaller than the default's (8 x 128 tokens, not 128 x 512) so the two runs take about a
minute each on two cores; what is capped does not grow with it beyond the sampler's rows, which the cap sets.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from quantkit.data import load_eval_windows
from quantkit.evaluate.backends import score_quantkit
from quantkit.models.embedded import embedded_model_dir
from quantkit.recipe.memory_cap import parse_size

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent
PROSE = HERE.parent / "bench" / "data" / "eval_prose.txt"
CAP = "448MiB"


def _quantise(out: Path, cap: str | None) -> dict:
    overrides = {"model": str(embedded_model_dir()), "output": str(out), "calibration.num_samples": 8,
                 "calibration.seq_len": 128, **({"max_memory": f"cpu={cap}"} if cap else {})}
    p = subprocess.run([sys.executable, str(HERE / "anon_peak.py"), json.dumps(overrides)], capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_the_default_fits_a_cap_below_the_float_model_and_scores_as_uncapped(tmp_path):
    capped = _quantise(tmp_path / "capped", CAP)
    sampled_by = capped["summary"]["calibration"]["sampled_by"]
    assert sampled_by["model"] == "rtn-w8 copy" and sampled_by["float_bytes"] > parse_size(CAP), sampled_by
    assert capped["summary"]["loading"] == "layer by layer"
    assert capped["peak_above_imports"] <= parse_size(CAP), capped["peak_above_imports"] / 2**20
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # the code spool is gone

    uncapped = _quantise(tmp_path / "uncapped", None)
    assert uncapped["summary"]["calibration"]["sampled_by"]["model"] == "float"
    assert capped["summary"]["method"] == uncapped["summary"]["method"]

    windows = [list(w) for w in load_eval_windows(str(PROSE), AutoTokenizer.from_pretrained(embedded_model_dir()),
                                                  seq_len=512, max_windows=8)]
    ppl = {k: score_quantkit(str(tmp_path / k), windows, [], 0, "float32").perplexity
           for k in ("capped", "uncapped")}
    assert abs(math.log(ppl["capped"] / ppl["uncapped"])) <= math.log(1.01), ppl
