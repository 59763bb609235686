"""Which way of calibrating experts is the better default: only the tokens routed to each expert, or every token
through every expert (the routed output kept), with and without the RTN fallback for starved experts.

No real MoE model installs here (none is on PyPI), so the models are tiny random Qwen3-MoE / Mixtral / OLMoE
configs with SmolLM2's tokenizer and vocabulary, their routers sharpened (router std x ROUTER_GAIN) so routing
is as uneven as in trained models, where a few experts take most tokens. Calibration on calibration/texts/
prose_calib.txt, evaluation on bench/data/eval_prose.txt (disjoint text): mean KL(float || quantised) of the
next-token distributions and top-1 agreement, W4 g32 GPTQ. Random weights make these fidelity measures, not
quality ones; the table says how far each variant moves the model from its float self.

    python bench/moe_calibration.py [--layers 2] [--samples 16] [--seq-len 128]
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
ROUTER_GAIN = 8.0
VARIANTS = {  # name -> recipe quant overrides
    "rtn": {"method": "rtn"},
    "gptq routed, no fallback": {"method": "gptq", "moe": {"min_tokens": 0}},
    "gptq routed, rtn < 16 tokens": {"method": "gptq", "moe": {"min_tokens": 16}},
    "gptq all tokens": {"method": "gptq", "moe": {"calibrate_all_experts": True}},
}


def _tokens(tok, path: Path, n: int, length: int) -> list[torch.Tensor]:
    ids = tok(path.read_text())["input_ids"]
    return [torch.tensor(ids[i * length:(i + 1) * length]) for i in range(min(n, len(ids) // length))]


def _model(arch: str, layers: int, vocab: int):
    from quantkit.models.moe import unfuse_experts
    from quantkit.testing.moe import tiny_moe

    m = tiny_moe(arch, layers=layers, vocab_size=vocab)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(ROUTER_GAIN)
    unfuse_experts(m)
    return m


@torch.no_grad()
def _fidelity(ref, model, windows) -> tuple[float, float]:
    kl, agree, n = 0.0, 0, 0
    for w in windows:
        p = ref(w[None]).logits[0].float().log_softmax(-1)
        q = model(w[None]).logits[0].float().log_softmax(-1)
        kl += float((p.exp() * (p - q)).sum())
        agree += int((p.argmax(-1) == q.argmax(-1)).sum())
        n += w.numel()
    return kl / n, agree / n


def run(arch: str, args, tok, calib, windows) -> list[dict]:
    import copy

    from quantkit.models.moe import experts_modules
    from quantkit.pipeline import quantize_model
    from quantkit.plan import build_plan
    from quantkit.recipe import Recipe

    ref = _model(arch, args.layers, len(tok))
    rows = []
    for name, quant in VARIANTS.items():
        model = copy.deepcopy(ref)
        recipe = Recipe.model_validate({"quant": {"group_size": 32, **quant}})
        t = time.time()
        res = quantize_model(model, build_plan(model, recipe), calib)
        seconds = time.time() - t
        routed = [c for m in experts_modules(model).values() for c in m.routed.tolist()]
        kl, agree = _fidelity(ref, model, windows)
        fallback = sum(1 for n, s in res.stats.items() if ".experts." in n and s.get("fallback"))
        rows.append({"arch": arch, "variant": name, "kl": kl, "agree": agree, "seconds": seconds,
                     "fewest_routed": min(routed) if routed else None, "rtn_fallback": fallback})
    return rows


def main() -> None:
    from transformers import AutoTokenizer

    from quantkit.models.embedded import embedded_model_dir
    from quantkit.testing.models import single_thread

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--archs", default="qwen3_moe,mixtral,olmoe")
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(embedded_model_dir())
    calib = _tokens(tok, ROOT / "calibration/texts/prose_calib.txt", args.samples, args.seq_len)
    windows = _tokens(tok, ROOT / "bench/data/eval_prose.txt", 8, 256)
    print(f"| arch | variant | KL(float‖quant) | top-1 agreement | fewest tokens routed to an expert "
          f"| experts' Linears on RTN | seconds |\n|---|---|---:|---:|---:|---:|---:|")
    with single_thread():
        for arch in args.archs.split(","):
            for r in run(arch, args, tok, calib, windows):
                print(f"| {r['arch']} | {r['variant']} | {r['kl']:.5f} | {r['agree']:.3f} | {r['fewest_routed']} "
                      f"| {r['rtn_fallback']} | {r['seconds']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
