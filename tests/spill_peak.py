"""Quantise a one-layer model 1024 wide to static W8A8 (RTN weights, calibrated input scales) on 32 x 512 random
tokens, keeping the calibration activations in memory or spilling them to disk, and print as JSON the peak of anonymous memory above the imported process:
`python tests/spill_peak.py memory|spill` (tests/test_activation_spill.py compares the two; anon_peak.py says
why anonymous memory is what counts)."""
from __future__ import annotations

import json
import sys
import tempfile
import threading
import time
from pathlib import Path

from anon_peak import rss_anon


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from quantkit.capture.spill import Spill
    from quantkit.pipeline import quantize_model
    from quantkit.plan import build_plan
    from quantkit.recipe import Recipe

    torch.set_num_threads(2)
    cfg = LlamaConfig(vocab_size=256, hidden_size=1024, intermediate_size=1024, num_hidden_layers=1,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    calib = [torch.randint(0, 256, (512,), generator=torch.Generator().manual_seed(i)) for i in range(32)]
    # static INT8 input scales need the calibration inputs and little else: the activations dominate what is held
    plan = build_plan(model, Recipe.model_validate({"quant": {"scheme": "w8a8-static", "method": "rtn"}}))
    torch.ones(256, 256) @ torch.ones(256, 256)
    base, peak, done = rss_anon(), [0], threading.Event()

    def poll():
        while not done.is_set():
            peak[0] = max(peak[0], rss_anon())
            time.sleep(0.001)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    with tempfile.TemporaryDirectory() as folder:
        spill = Spill(Path(folder), cap=1) if sys.argv[1] == "spill" else None
        result = quantize_model(model, plan, calib, spill=spill)
    done.set()
    poller.join()
    print(json.dumps({"peak": peak[0] - base, "activations": result.activations,
                      "set_bytes": 32 * 512 * cfg.hidden_size * 4}))


if __name__ == "__main__":
    main()
