"""One row of bench/quality.py run by llm-compressor's GPTQ, in a virtual environment that has llmcompressor.

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

from quality_common import load_model, peak_rss_mb, perplexity, write_result  # noqa: E402

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
    from llmcompressor.modifiers.quantization import GPTQModifier

    row = json.loads(a.row)
    fields = json.loads(a.scheme_fields)
    opts = row["method"]["options"]
    data = torch.load(a.tokens)
    calib = [s.tolist() for s in data["calib"]]
    gs = fields["quant.group_size"]
    weights = {"num_bits": BITS[fields["quant.scheme"]], "type": "int", "symmetric": fields["quant.symmetric"],
               "strategy": "channel" if gs == -1 else "group", "group_size": None if gs == -1 else gs}
    modifier = GPTQModifier(config_groups={"group_0": {"targets": ["Linear"], "weights": weights}},
                            ignore=["lm_head"], actorder=ACTORDER[opts.get("actorder")],
                            dampening_frac=0.01, block_size=128)
    ds = Dataset.from_dict({"input_ids": calib, "attention_mask": [[1] * len(c) for c in calib]})
    model = load_model(a.model)
    result = {"load_rss_mb": peak_rss_mb()}
    t, c = time.perf_counter(), time.process_time()
    oneshot(model=model, dataset=ds, recipe=modifier, num_calibration_samples=len(calib),
            max_seq_length=max(len(c) for c in calib), shuffle_calibration_samples=False)
    result["quant_seconds"] = time.perf_counter() - t
    result["quant_cpu_seconds"] = time.process_time() - c
    result["peak_rss_mb"] = peak_rss_mb()
    # after oneshot the Linears run quantise-dequantise on their weights, so this scores the quantised model
    result["ppl"] = perplexity(model, data["eval"])
    write_result(a.out, result)


if __name__ == "__main__":
    main()
