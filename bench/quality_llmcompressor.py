"""One row of bench/quality.py run by llm-compressor (GPTQ, AWQ or both), in a virtual environment that has it.

Takes the same calibration tokens and evaluation windows as quantkit's rows and scores them with the same
perplexity code (quality_common.py), so the rows compare like with like. Not meant to be run by hand.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from quality_common import load_model, peak_rss_mb, reset_peak_rss, score, write_result  # noqa: E402

BITS = {"w4a16": 4, "w8a16": 8}
# our actorder names -> compressed-tensors' ActivationOrdering ("weight" is what it calls static)
ACTORDER = {None: None, "off": None, "weight": "static", "group": "group"}


def main() -> None:
    ap = argparse.ArgumentParser()
    for k in ("--row", "--scheme-fields", "--model", "--tokens", "--out"):
        ap.add_argument(k, required=True)
    ap.add_argument("--threads", type=int)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    row = json.loads(a.row)
    fields = json.loads(a.scheme_fields)
    opts = row["method"]["options"]
    data = torch.load(a.tokens)
    calib = [s.tolist() for s in data["calib"]]
    gs = fields["quant.group_size"]
    weights = {"num_bits": BITS[fields["quant.scheme"]], "type": "int", "symmetric": fields["quant.symmetric"],
               "strategy": "channel" if gs == -1 else "group", "group_size": None if gs == -1 else gs}
    groups = {"group_0": {"targets": ["Linear"], "weights": weights}}
    algo = opts.get("algo", "gptq")
    gptq = dict(config_groups=groups, ignore=["lm_head"], actorder=ACTORDER[opts.get("actorder")],
                dampening_frac=0.01, block_size=128)
    if algo == "gptq":
        recipe = GPTQModifier(**gptq)
    else:
        # 0.14 split AWQ into a transform (scales only) followed by whichever modifier quantises
        from llmcompressor.modifiers.transform import AWQModifier
        from llmcompressor.pipelines.cache import IntermediatesCache

        if not torch.accelerator.is_available():
            # 0.14's AWQ pins its cached activations unconditionally, and pin_memory() raises without an
            # accelerator; pinning only speeds host-to-device copies, so skipping it leaves the numbers unchanged
            IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None

        last = GPTQModifier(**gptq) if algo == "awq+gptq" else QuantizationModifier(config_groups=groups,
                                                                                   ignore=["lm_head"])
        recipe = [AWQModifier(), last]
    ds = Dataset.from_dict({"input_ids": calib, "attention_mask": [[1] * len(c) for c in calib]})
    model = load_model(a.model)
    result = {"load_rss_mb": peak_rss_mb()}
    # from here the peak is the quantisation's own (with the float model resident), not the load's
    result["peak_reset"] = reset_peak_rss()
    t, c = time.perf_counter(), time.process_time()
    oneshot(model=model, dataset=ds, recipe=recipe, num_calibration_samples=len(calib),
            max_seq_length=max(len(c) for c in calib), shuffle_calibration_samples=False)
    result["quant_seconds"] = time.perf_counter() - t
    result["quant_cpu_seconds"] = time.process_time() - c
    result["peak_rss_mb"] = peak_rss_mb()
    # after oneshot the Linears run quantise-dequantise on their weights, so this scores the quantised model
    s = score(model, data["eval"], data["ref_top1"])
    result["ppl"], result["agreement"] = s["ppl"], s["agreement"]
    write_result(a.out, result)


if __name__ == "__main__":
    main()
