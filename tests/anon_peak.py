"""Run one quantise job in this process and print, as JSON, the peak of its anonymous memory above the imported
process: `python tests/anon_peak.py RECIPE_OVERRIDES_JSON`.

What a capped run may hold is the model's data, not the interpreter and the libraries (torch, transformers) it
imports, so the baseline is taken after those imports and one warm-up of torch's allocator. Anonymous memory
(RssAnon) is what the cap bounds; file-backed pages (the mmapped source weights, the spooled codes) are the
kernel's to drop under pressure, and VmHWM would count them. The kernel keeps no high-water mark of RssAnon, so a
thread samples it every millisecond.
"""
from __future__ import annotations

import json
import sys
import threading
import time


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def main() -> None:
    import torch

    from quantkit.job import quantize_to_checkpoint
    from quantkit.recipe import Recipe, apply_overrides

    torch.ones(256, 256) @ torch.ones(256, 256)
    overrides = json.loads(sys.argv[1])
    base = rss_anon()
    peaks: dict[str, int] = {}
    stage = ["loading"]  # what the job is doing now, as the wrappers below say
    done = threading.Event()

    def poll():
        while not done.is_set():
            label, now = stage[0], rss_anon()
            peaks[label] = max(peaks.get(label, 0), now)
            time.sleep(0.001)

    def staged(module, name: str, label: str, after: str):
        """While MODULE.NAME runs, the job's stage is LABEL; AFTER once it returns."""
        real = getattr(module, name)

        def run(*args, **kwargs):
            stage[0] = label
            try:
                return real(*args, **kwargs)
            finally:
                stage[0] = after
        setattr(module, name, run)

    import quantkit.formats.writer
    import quantkit.pipeline
    import quantkit.pipeline.sampling_copy

    staged(quantkit.pipeline.sampling_copy, "sample_with_rtn_copy", "sampling", "after sampling")
    staged(quantkit.pipeline, "quantize_model", "solving", "after solving")
    staged(quantkit.formats.writer, "write_checkpoint", "writing", "after writing")
    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    summary = quantize_to_checkpoint(apply_overrides(Recipe(), overrides))
    done.set()
    poller.join()
    stages = {k: v - base for k, v in peaks.items()}
    print(json.dumps({"peak_above_imports": max(stages.values()), "stages": stages, "base": base, "summary": summary},
                     default=str))


if __name__ == "__main__":
    main()
