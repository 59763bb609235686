"""Where FP8 error comes from on the embedded SmolLM2-135M: weights or activations, which layers, how lucky.

    python bench/fp8_error_split.py                                  # the standard variants below
    python bench/fp8_error_split.py "channel:" ":token:down_proj"    # your own variants

A variant is WEIGHTS:ACTIVATIONS[:MODULES]. WEIGHTS is tensor or channel (absmax E4M3 rounding of the weights,
optionally @F to multiply the scale by F), empty for float weights. ACTIVATIONS is token (per-token dynamic),
static (calibration absmax, optionally @M as the margin), search (the scale the checkpoint path picks, here per
Linear, without sharing between q/k/v: solvers/fp8_input_scale.py, @M as for static), or empty for float inputs.
MODULES is a comma list of name fragments limiting the variant to the Linears whose names contain one (default
every Linear but lm_head).
Everything is fake-quantised in float32 on the float model (quantkit.e4m3, the rounding the checkpoint path
uses), so the rows isolate one source of error each; bench/fp8_quality.py runs the real checkpoints.

It also prints, per Linear, how far the evaluation text's inputs exceed the calibration absmax: the reason the
static input scale carries a margin (solvers/fp8.py INPUT_MARGIN).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from fp8_quality import perplexity  # noqa: E402
from quality_common import load_model  # noqa: E402

from quantkit.shipped import shipped_dir  # noqa: E402

STANDARD = [
    "tensor:", "channel:", ":token", ":static@1", ":static@2",
    # the same rounding with the scale nudged: how much of a perplexity change is the luck of the roundings
    "tensor@1.013:", "tensor@1.031:", "channel@1.02:", "channel@1.05:",
    ":token:q_proj,k_proj,v_proj", ":token:o_proj", ":token:gate_proj,up_proj", ":token:down_proj",
]


def observe(model, linears: dict, samples) -> dict:
    """The checkpoint path's static input-scale statistics (absmax and histogram) of every Linear."""
    from quantkit.solvers.fp8_input_scale import InputScale

    obs = {n: InputScale(n, m.weight) for n, m in linears.items()}
    handles = [m.register_forward_pre_hook(lambda _m, args, o=obs[n]: o.add(args[0])) for n, m in linears.items()]
    with torch.no_grad():
        for s in samples:
            model(input_ids=s.reshape(1, -1))
    for h in handles:
        h.remove()
    return obs


def apply_variant(spec: str, linears: dict, originals: dict, calib: dict) -> list:
    from quantkit import e4m3

    weights, acts, *rest = spec.split(":") + [""]
    only = [f for f in rest[0].split(",") if f] if rest else []
    handles = []
    for name, mod in linears.items():
        w = originals[name]
        mod.weight.data = w.clone()
        if only and not any(f in name for f in only):
            continue
        if weights:
            kind, _, mult = weights.partition("@")
            amax = w.abs().amax().reshape(1) if kind == "tensor" else w.abs().amax(1, keepdim=True)
            mod.weight.data = e4m3.fake_quantize(w, e4m3.scale_for(amax) * float(mult or 1))
        if acts.startswith("token"):
            handles.append(mod.register_forward_pre_hook(lambda _m, args: (e4m3.fake_quantize(args[0]),)))
        elif acts.startswith(("static", "search")):
            margin = float(acts.partition("@")[2] or 1)
            if acts.startswith("search"):
                s = calib[name].scale(torch.float32, margin)[0]
            else:
                s = e4m3.scale_for(calib[name].amax.reshape(1), margin)
            handles.append(mod.register_forward_pre_hook(lambda _m, args, s=s: (e4m3.fake_quantize(args[0], s),)))
    return handles


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("variants", nargs="*", help="WEIGHTS:ACTIVATIONS[:MODULES] (default: a standard list)")
    ap.add_argument("--calib", default=str(shipped_dir("calibration") / "texts" / "prose_calib.txt"))
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--eval", default=str(HERE / "data" / "eval_prose.txt"))
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)

    from transformers import AutoTokenizer

    from quantkit.data import load_calibration, load_eval_windows
    from quantkit.models.embedded import embedded_model_dir

    path = str(embedded_model_dir())
    tok = AutoTokenizer.from_pretrained(path)
    windows = list(load_eval_windows(a.eval, tok, seq_len=512, max_windows=16))
    calib = load_calibration(spec=a.calib, tokenizer=tok, num_samples=a.samples, seq_len=a.seq_len, seed=0).samples
    model = load_model(path)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in n}
    originals = {n: m.weight.data.clone() for n, m in linears.items()}
    calib_obs = observe(model, linears, calib)
    calib_amax = {n: float(o.amax) for n, o in calib_obs.items()}
    eval_amax = {n: float(o.amax) for n, o in observe(model, linears, windows).items()}
    base, _, _, ref = perplexity(model, windows, False, keep=True)
    print("| variant (weights:activations:modules) | perplexity | vs float | KL to float (1e-3 nats/token) |")
    print("|---|---:|---:|---:|")
    print(f"| float32 | {base:.3f} | - | - |", flush=True)
    for spec in a.variants or STANDARD:
        handles = apply_variant(spec, linears, originals, calib_obs)
        ppl, _, kl, _ = perplexity(model, windows, False, ref)
        for h in handles:
            h.remove()
        print(f"| `{spec}` | {ppl:.3f} | {(ppl / base - 1) * 100:+.2f}% | {kl * 1e3:.2f} |", flush=True)
    for n, m in linears.items():
        m.weight.data = originals[n]
    ratios = sorted(((eval_amax[n] / calib_amax[n], n) for n in linears), reverse=True)
    over = sum(r > 1 for r, _ in ratios)
    print(f"\nLinears whose evaluation inputs exceed the calibration absmax: {over} of {len(ratios)}; largest: "
          + ", ".join(f"{n} {r:.2f}x" for r, n in ratios[:4]))
    print(f"calibration: {Path(a.calib).name}, {len(calib)} x {a.seq_len} tokens; evaluation: {Path(a.eval).name}, "
          f"{len(windows)} windows x 512 tokens; threads {torch.get_num_threads()}")


if __name__ == "__main__":
    main()
