"""Issue 39.5: the default (self-sampled calibration, `--method auto`) runs on SmolLM2 under a --max-memory cap
below its float model and holds at most the cap. The cap was 448MiB until the float model's openings
(models/streamed_forward.py): since then the solving stage peaked at 427-450 MiB there (it was 407-420; cause not
found), so 448MiB left no margin and 480MiB keeps the ~30 MiB it had; since the heap is also trimmed after each
calibration pass and AWQ search (quantkit/heap.py) the solving stage peaked near 370 MiB, below sampling's ~410;
since `auto` runs AWQ+GPTQ at every calibration size, GPTQ's Hessians take it to ~455 MiB (docs/distributed.md). (Its score against the uncapped default is
the benchmark's, `python -m bench capped_default`: one seed's text says little, and five seeds both ways take ten
minutes.)

SmolLM2-135M computes in float32 on a CPU: 538 MB (513 MiB) of weights. Under cpu=480MiB the float model cannot
sample, so a round-to-nearest W8 copy built while the layers stream samples the calibration text
(pipeline/sampling_copy.py), the float layers stream again to be solved, and each layer's codes go to disk as they
are solved (formats/code_spool.py). The peak counted is anonymous memory above the imported process
(tests/anon_peak.py says why). The calibration is smaller than the default's (8 x 128 tokens, not 128 x 512) so
the run takes about a minute on two cores; what is capped does not grow with it beyond the sampler's rows, which
the cap sets.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from quantkit.models.embedded import embedded_model_dir
from quantkit.recipe.memory_cap import parse_size

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent
CAP = "480MiB"


def _quantise(out: Path, cap: str) -> dict:
    overrides = {"model": str(embedded_model_dir()), "output": str(out), "calibration.num_samples": 8,
                 "calibration.seq_len": 128, "max_memory": f"cpu={cap}"}
    p = subprocess.run([sys.executable, str(HERE / "anon_peak.py"), json.dumps(overrides)], capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_the_default_fits_a_cap_below_the_float_model(tmp_path):
    capped = _quantise(tmp_path / "capped", CAP)
    sampled_by = capped["summary"]["calibration"]["sampled_by"]
    assert sampled_by["model"] == "rtn-w8 copy" and sampled_by["float_bytes"] > parse_size(CAP), sampled_by
    assert capped["summary"]["loading"] == "layer by layer"
    assert capped["peak_above_imports"] <= parse_size(CAP), capped["peak_above_imports"] / 2**20
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # the code spool is gone
