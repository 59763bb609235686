"""What the older quality scripts share: opening the float model, perplexity, peak RSS.

The model is opened by `quantkit.load` (the checkpoint's own modules, float32: the baseline carries no float16
rounding, and solvers quantise those modules in place) and scored by bench/score.py, quantkit's own perplexity,
like every `python -m bench` suite. A worker run by another library's virtual environment (llm-compressor)
imports quantkit from this checkout, so that environment needs quantkit's few dependencies (pydantic, PyYAML).
"""
from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.score import score  # noqa: E402,F401


def peak_rss_mb() -> float:
    """Peak resident memory of this process since start or the last reset_peak_rss()."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS; never reset
    return r / (1024 * 1024) if sys.platform == "darwin" else r / 1024


def reset_peak_rss() -> bool:
    """Restart the peak at the current RSS (Linux: writing 5 to clear_refs), so that a later peak_rss_mb()
    measures one phase (quantising) and not an earlier, larger one (loading). False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def load_model(path: str):
    import quantkit

    return quantkit.load(path, exact=True, dtype=torch.float32)


def perplexity(model, windows: list[torch.Tensor]) -> float:
    return score(model, windows)["ppl"]


def write_result(path: str, result: dict) -> None:
    with open(path, "w") as f:
        json.dump(result, f)
