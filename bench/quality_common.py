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
    from transformers import AutoModelForCausalLM

    # float32 on CPU: float16 matmuls are slow there, and the baseline should not carry fp16 rounding
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model


@torch.no_grad()
def score(model, windows: list[torch.Tensor], ref_top1: torch.Tensor | None = None, batch: int = 4) -> dict:
    """Perplexity, and agreement with a reference model's greedy tokens when ref_top1 is given.

    Perplexity is exp(mean next-token NLL) over every predicted token of the equal-length, non-overlapping
    windows. Agreement is teacher-forced: at each position of the same windows, does this model's argmax equal
    the reference's (ref_top1, as returned here under "top1")? Teacher forcing keeps every position scored on the
    same prefix, so one early divergence does not decide the rest of a window.
    """
    nll, count, same = 0.0, 0, 0
    tops = []
    for i in range(0, len(windows), batch):
        ids = torch.stack(windows[i:i + batch])
        logits = model(input_ids=ids, use_cache=False).logits.float()
        lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])
        nll -= float(lp.sum())
        count += lp.numel()
        top = logits.argmax(-1)
        tops.append(top)
        if ref_top1 is not None:
            same += int((top == ref_top1[i:i + batch]).sum())
    top1 = torch.cat(tops)
    return {"ppl": math.exp(nll / count), "top1": top1,
            "agreement": None if ref_top1 is None else same / top1.numel()}


def perplexity(model, windows: list[torch.Tensor], batch: int = 4) -> float:
    return score(model, windows, batch=batch)["ppl"]


def write_result(path: str, result: dict) -> None:
    with open(path, "w") as f:
        json.dump(result, f)
