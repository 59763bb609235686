"""FP8 quality on the embedded SmolLM2-135M: perplexity of FP8 weights/activations and of the FP8 KV cache.

    python bench/fp8_quality.py                  # every row (a few minutes on 2 CPU cores)
    python bench/fp8_quality.py --only kv        # rows whose label contains the text

Each quantised row goes through the real path: quantize_model -> checkpoint -> quantkit.load (FP8Linear with
its activation quantisation) and, for the KV rows, FP8KVCache with the scales calibrated by --kv-cache fp8.
Perplexity windows run as one prefill through the cache, so every attention reads FP8 keys and values, as in a
token-by-token decode with the same cache (tests/test_kv_cache_fp8.py checks that equivalence). Everything runs
in float32 on the CPU so the float baseline carries no fp16 rounding; FP8 is emulated exactly (bench/fp8_gpu.py
times the real FP8 matmuls on a GPU).
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

from quality_common import load_model  # noqa: E402

from quantkit.shipped import shipped_dir  # noqa: E402

# label -> (recipe quant fields or None for float weights, FP8 KV cache?)
ROWS: dict[str, tuple[dict | None, bool]] = {
    "float32": (None, False),
    "fp8 (tensor W, static A)": ({"scheme": "fp8"}, False),
    "fp8-dynamic (channel W, token A)": ({"scheme": "fp8-dynamic"}, False),
    "float32 + FP8 KV": (None, True),
    "W4 g64 RTN": ({"scheme": "w4a16", "group_size": 64, "method": "rtn"}, False),
    "W4 g64 RTN + FP8 KV": ({"scheme": "w4a16", "group_size": 64, "method": "rtn"}, True),
    "fp8-dynamic + FP8 KV": ({"scheme": "fp8-dynamic"}, True),
    # the same schemes with the weights rounded by GPTQ instead of absmax rounding (solvers/fp8_gptq.py)
    "fp8 GPTQ (tensor W, static A)": ({"scheme": "fp8", "method": "gptq"}, False),
    "fp8-dynamic GPTQ (channel W, token A)": ({"scheme": "fp8-dynamic", "method": "gptq"}, False),
    "fp8-dynamic GPTQ + FP8 KV": ({"scheme": "fp8-dynamic", "method": "gptq"}, True),
}
# The weight half of each fp8 row's error: the same checkpoint with its activations left unquantised
# (FP8Linear.quantize_input passed through); the rest of the row's error is the activations'.
WEIGHTS_ONLY = " [weights only]"
for _label in [lb for lb, (q, kv) in ROWS.items() if q and q["scheme"].startswith("fp8") and not kv]:
    ROWS[_label + WEIGHTS_ONLY] = ROWS[_label]


@torch.no_grad()
def perplexity(model, windows, fp8_kv: bool, ref: list | None = None,
               keep: bool = False) -> tuple[float, float, float | None, list]:
    """(perplexity, KV bytes per token, mean KL(ref || model) per token or None, log-probs if keep else []): one
    window at a time, through a fresh cache each. KL to the float model's next-token distributions ranks rows with
    far less noise than a perplexity difference on a few thousand tokens, whose sign is partly the luck of the
    roundings. keep: return every window's log-probs (the reference for later calls; ~100 MB a window)."""
    from quantkit.runtime.fp8_kv_cache import FP8KVCache
    from transformers import DynamicCache

    from quantkit.evaluate.perplexity import nll as token_nll, perplexity as ppl

    total, kl, count, kv_bytes, kv_tokens, out = 0.0, 0.0, 0, 0, 0, []
    for i, ids in enumerate(windows):
        ids = ids.reshape(1, -1)
        cache = FP8KVCache.from_model(model) if fp8_kv else DynamicCache(config=model.config)
        logits = model(input_ids=ids, cache=cache, use_cache=True).logits.float()
        lp = torch.log_softmax(logits[0, :-1], -1)
        total += float(token_nll(lp, ids[0, 1:]).sum())
        count += lp.shape[0]
        if ref is not None:
            kl += float((ref[i].exp() * (ref[i] - lp)).sum())
        if keep:
            out.append(lp)
        kv_bytes += sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
        kv_tokens += ids.shape[1]
    return ppl(total, count), kv_bytes / kv_tokens, None if ref is None else kl / count, out


@contextlib.contextmanager
def activations_unquantised(active: bool):
    from quantkit.linear.fp8 import FP8Linear

    original = FP8Linear.quantize_input
    if active:
        FP8Linear.quantize_input = lambda self, x: (x, torch.ones(1))
    try:
        yield
    finally:
        FP8Linear.quantize_input = original


def build(label: str, model_path: str, calib, workdir: str):
    """The model of one row, ready to evaluate."""
    import quantkit
    from quantkit.formats.writer import write_checkpoint
    from quantkit.pipeline import quantize_model
    from quantkit.plan import build_plan
    from quantkit.recipe import Recipe
    from quantkit.runtime.loader import attach_kv_scales
    from quantkit.solvers.kv_scales import calibrate_kv_scales

    quant, kv = ROWS[label]
    model = load_model(model_path)
    if quant is None:
        if kv:
            attach_kv_scales(model, {k: t.float() for k, t in calibrate_kv_scales(model, calib).items()})
        return model, None
    recipe = Recipe.model_validate({"quant": {**quant, **({"kv_cache": "fp8"} if kv else {})}})
    t = time.perf_counter()
    res = quantize_model(model, build_plan(model, recipe), calib)
    seconds = time.perf_counter() - t
    kv_scheme = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False} \
        if kv else None
    out = Path(workdir) / f"row{abs(hash(label))}"
    write_checkpoint(out, model, res.qweights, build_plan(model, recipe).schemes, None, {}, res.tensors, kv_scheme)
    return quantkit.load(out, dtype=torch.float32, exact=True), seconds


def text_args(description: str, argv=None):
    """The options every embedded-model quality bench shares (w8a8_quality.py too): the same calibration and
    evaluation text by default, so their rows sit side by side; torch's thread count is set from them."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--calib", default=str(shipped_dir("calibration") / "texts" / "prose_calib.txt"),
                    help="calibration spec (quantkit.data.load_calibration); real prose by default")
    ap.add_argument("--samples", type=int, default=10, help="10 x 256 tokens is all the default file holds")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--eval", default=str(HERE / "data" / "eval_prose.txt"))
    ap.add_argument("--eval-seq-len", type=int, default=512)
    ap.add_argument("--max-windows", type=int, default=8)
    ap.add_argument("--only", help="rows whose label contains this (case-insensitive); '|' separates several")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steady timings on a shared machine)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    return a


def load_texts(a) -> tuple[str, list, list]:
    """(the embedded model's folder, calibration samples, evaluation windows) for text_args' options."""
    from transformers import AutoTokenizer

    from quantkit.data import load_calibration, load_eval_windows
    from quantkit.models.embedded import embedded_model_dir

    model_path = str(embedded_model_dir())
    tok = AutoTokenizer.from_pretrained(model_path)
    calib = load_calibration(spec=a.calib, tokenizer=tok, num_samples=a.samples, seq_len=a.seq_len, seed=0).samples
    windows = list(load_eval_windows(a.eval, tok, seq_len=a.eval_seq_len, max_windows=a.max_windows))
    return model_path, calib, windows


def main(argv=None) -> None:
    a = text_args(__doc__.split("\n")[0], argv)
    model_path, calib, windows = load_texts(a)
    wanted = [w.strip().lower() for w in a.only.split("|")] if a.only else []
    labels = [lb for lb in ROWS if not wanted or any(w == lb.lower() or w in lb.lower() for w in wanted)]
    results = {}
    base, _, _, ref = perplexity(load_model(model_path), windows, False, keep=True)
    with tempfile.TemporaryDirectory(prefix="quantkit-fp8-bench-") as workdir:
        for label in labels:
            model, seconds = build(label, model_path, calib, workdir)
            with activations_unquantised(label.endswith(WEIGHTS_ONLY)):
                ppl, kv_per_token, kl, _ = perplexity(model, windows, ROWS[label][1], ref)
            results[label] = (ppl, kv_per_token, kl, seconds)
            print(f"{label}: ppl {ppl:.4f}, KL {kl * 1e3:.2f}e-3, KV {kv_per_token:.0f} B/token", file=sys.stderr,
                  flush=True)
            del model
    print("| weights / activations | KV cache | perplexity | vs float | KL to float (1e-3 nats/token) "
          "| KV bytes/token | quantise s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for label, (ppl, kvb, kl, qs) in results.items():
        w, _, kv = label.partition(" + ")
        delta = "-" if label == "float32" else f"{(ppl / base - 1) * 100:+.2f}%"
        kl_s = "-" if label == "float32" else f"{kl * 1e3:.2f}"
        print(f"| {w} | {kv or 'float32'} | {ppl:.3f} | {delta} | {kl_s} | {kvb:.0f} | "
              f"{'-' if qs is None else f'{qs:.0f}'} |")
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_path)
    per_elem = 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads)
    print(f"\nKV elements per token: {per_elem} (K+V x {c.num_hidden_layers} layers x {c.num_key_value_heads} kv "
          f"heads x head dim): fp8 {per_elem} B, bf16/fp16 {2 * per_elem} B, float32 {4 * per_elem} B")
    print(f"calibration: {Path(a.calib).name}, {len(calib)} x {a.seq_len} tokens; evaluation: "
          f"{Path(a.eval).name}, {len(windows)} windows x {a.eval_seq_len} tokens")


if __name__ == "__main__":
    main()
