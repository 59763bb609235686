"""What every quality-benchmark worker shares, ours or another library's: loading the model, perplexity, peak RSS.

Imports nothing from quantkit, so a worker running in another library's virtual environment can use it too and
every row is scored by the same code on the same tokens.
"""
from __future__ import annotations

import json
import math
import resource
import sys

import torch


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far (ru_maxrss is KiB on Linux, bytes on macOS)."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / (1024 * 1024) if sys.platform == "darwin" else r / 1024


def load_model(path: str):
    from transformers import AutoModelForCausalLM

    # float32 on CPU: float16 matmuls are slow there, and the baseline should not carry fp16 rounding
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model


@torch.no_grad()
def perplexity(model, windows: list[torch.Tensor], batch: int = 4) -> float:
    """exp(mean next-token NLL) over every predicted token of the equal-length, non-overlapping windows."""
    nll, count = 0.0, 0
    for i in range(0, len(windows), batch):
        ids = torch.stack(windows[i:i + batch])
        logits = model(input_ids=ids, use_cache=False).logits.float()
        lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])
        nll -= float(lp.sum())
        count += lp.numel()
    return math.exp(nll / count)


def write_result(path: str, result: dict) -> None:
    with open(path, "w") as f:
        json.dump(result, f)
