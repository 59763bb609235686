"""One llm-compressor checkpoint for bench/llmc_schemes.py: W8A8 INT8 (with or without SmoothQuant, dynamic or
static activations) or FP4 weights (NVFP4A16, MXFP4A16), rounded by RTN or GPTQ. Runs inside a virtual
environment that has llmcompressor (.venv-llmc); not meant to be run by hand.

    .venv-llmc/bin/python bench/llmc_schemes_worker.py --scheme W8A8 --algo gptq --smooth 0.8 \
        --model DIR --tokens tokens.pt --save OUT_DIR --out result.json --threads 1

Only llm-compressor's public API is used (oneshot, GPTQModifier, QuantizationModifier, SmoothQuantModifier and
compressed-tensors' preset scheme names), with its own defaults wherever quantkit's bench does not fix a value,
so each row is "what llm-compressor does out of the box" on the same calibration tokens.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from quality_common import load_model, peak_rss_mb, reset_peak_rss, score, write_result  # noqa: E402

# static per-tensor int8 activations: compressed-tensors has no preset for it ("W8A8" and "INT8" are both
# dynamic per token), so the scheme is spelled out; the weights are the W8A8 preset's (per-channel symmetric)
STATIC_INPUTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor", "dynamic": False}


def quant_kwargs(scheme: str) -> dict:
    """The modifier arguments that pick the scheme: a preset name, or config_groups for the static variant."""
    if scheme == "W8A8-static":
        from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

        weights = PRESET_SCHEMES["W8A8"]["weights"].model_dump()
        group = {"targets": ["Linear"], "weights": weights, "input_activations": STATIC_INPUTS}
        return {"config_groups": {"group_0": group}}
    return {"scheme": scheme, "targets": ["Linear"]}


# llm-compressor's default SmoothQuant mappings for Llama-style models smooth q/k/v (by input_layernorm) and
# gate/up (by post_attention_layernorm) only; --smooth-down adds down_proj, balanced against up_proj's rows, which
# quantkit's SmoothQuant also scales (o_proj stays out in both: grouped-query attention leaves it unscalable)
DEFAULT_MAPPINGS = [[["re:.*q_proj", "re:.*k_proj", "re:.*v_proj"], "re:.*input_layernorm"],
                    [["re:.*gate_proj", "re:.*up_proj"], "re:.*post_attention_layernorm"]]
DOWN_MAPPING = [["re:.*down_proj"], "re:.*up_proj"]


def recipe(scheme: str, algo: str, smooth: float | None, smooth_down: bool = False) -> list:
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.transform import SmoothQuantModifier

    # lm_head stays float as in quantkit's rows (SmolLM2 ties it to the embedding)
    kw = {**quant_kwargs(scheme), "ignore": ["lm_head"]}
    sq = {"mappings": DEFAULT_MAPPINGS + [DOWN_MAPPING]} if smooth_down else {}
    mods = [] if smooth is None else [SmoothQuantModifier(smoothing_strength=smooth, **sq)]
    # GPTQ with llm-compressor's defaults: act-order "static" (quantkit's "weight"), dampening 0.01, block 128
    mods.append(GPTQModifier(**kw) if algo == "gptq" else QuantizationModifier(**kw))
    return mods


def main() -> None:
    ap = argparse.ArgumentParser()
    for k in ("--scheme", "--algo", "--model", "--tokens", "--save", "--out"):
        ap.add_argument(k, required=True)
    ap.add_argument("--smooth", type=float, help="SmoothQuantModifier smoothing_strength (none: no SmoothQuant)")
    ap.add_argument("--smooth-down", action="store_true", help="also smooth down_proj by up_proj")
    ap.add_argument("--threads", type=int)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    import llmcompressor
    from datasets import Dataset
    from llmcompressor import oneshot

    data = torch.load(a.tokens)
    calib = [s.tolist() for s in data["calib"]]
    ds = Dataset.from_dict({"input_ids": calib, "attention_mask": [[1] * len(c) for c in calib]})
    model = load_model(a.model)
    result = {"llmcompressor": llmcompressor.__version__, "peak_reset": reset_peak_rss()}
    t, c = time.perf_counter(), time.process_time()
    mods = recipe(a.scheme, a.algo, a.smooth, a.smooth_down)
    oneshot(model=model, dataset=ds, recipe=mods, num_calibration_samples=len(calib),
            max_seq_length=max(len(x) for x in calib), shuffle_calibration_samples=False)
    result["quant_seconds"] = time.perf_counter() - t
    result["quant_cpu_seconds"] = time.process_time() - c
    result["peak_rss_mb"] = peak_rss_mb()
    # the in-memory model (quantise-dequantise in each Linear's forward) scored before saving: the driver
    # compares it with the checkpoint it reloads, which shows whether the reload kept the same arithmetic
    result["in_memory_ppl"] = score(model, data["eval"])["ppl"]
    model.save_pretrained(a.save, save_compressed=True)
    write_result(a.out, result)


if __name__ == "__main__":
    main()
