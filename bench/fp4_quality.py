"""FP4 quality on the embedded SmolLM2-135M: nvfp4 and mxfp4 (RTN and GPTQ) beside W4 g64 and FP8 rows.

    python bench/fp4_quality.py                  # every row (about 10 minutes on 2 CPU cores, one thread)
    python bench/fp4_quality.py --only nvfp4     # rows whose label contains the text ('|' separates several)

The calibration and evaluation text, the checkpoint path (quantize_model -> checkpoint -> quantkit.load) and
the perplexity/KL arithmetic are bench/fp8_quality.py's, so these rows sit beside its table. Added here: top-1
agreement, the share of evaluated positions where the row's most likely next token is the float model's. FP4
rows run through FP4Linear, which dequantises to float32 (there is no FP4 arithmetic on a CPU).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import fp8_quality  # noqa: E402
from quality_common import load_model  # noqa: E402

ROWS: dict[str, dict | None] = {
    "float32": None,
    "W4 g64 RTN": {"scheme": "w4a16", "group_size": 64, "method": "rtn"},
    "W4 g64 GPTQ": {"scheme": "w4a16", "group_size": 64, "method": "gptq"},
    "fp8-dynamic GPTQ (channel W, token A)": {"scheme": "fp8-dynamic", "method": "gptq"},
    "nvfp4 RTN": {"scheme": "nvfp4", "method": "rtn"},
    "nvfp4 GPTQ": {"scheme": "nvfp4", "method": "gptq"},
    "mxfp4 RTN": {"scheme": "mxfp4", "method": "rtn"},
    "mxfp4 GPTQ": {"scheme": "mxfp4", "method": "gptq"},
    "nvfp4-a4 RTN (activations too)": {"scheme": "nvfp4-a4", "method": "rtn"},
    "nvfp4-a4 GPTQ (activations too)": {"scheme": "nvfp4-a4", "method": "gptq"},
}


def bytes_per_weight(model) -> float | None:
    """Bytes the quantised Linears hold (codes and every scale, as loaded) per weight they stand for."""
    stored, weights = 0, 0
    for m in model.modules():
        bufs = dict(m.named_buffers(recurse=False))
        if not any(k in bufs for k in ("weight_packed", "weight_scale")):
            continue
        stored += sum(t.numel() * t.element_size() for k, t in bufs.items() if k.startswith("weight"))
        weights += m.in_features * m.out_features
    return stored / weights if weights else None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", help="rows whose label contains this (case-insensitive); '|' separates several")
    ap.add_argument("--max-windows", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    from transformers import AutoTokenizer

    from quantkit.data import load_calibration, load_eval_windows
    from quantkit.models.embedded import embedded_model_dir
    from quantkit.shipped import shipped_dir

    model_path = str(embedded_model_dir())
    tok = AutoTokenizer.from_pretrained(model_path)
    calib_file = shipped_dir("calibration") / "texts" / "prose_calib.txt"
    calib = load_calibration(spec=str(calib_file), tokenizer=tok, num_samples=10, seq_len=256, seed=0).samples
    windows = list(load_eval_windows(str(HERE / "data" / "eval_prose.txt"), tok, seq_len=512,
                                     max_windows=a.max_windows))
    wanted = [w.strip().lower() for w in a.only.split("|")] if a.only else []
    labels = [lb for lb in ROWS if not wanted or any(w in lb.lower() for w in wanted)]
    base, _, _, ref = fp8_quality.perplexity(load_model(model_path), windows, False, keep=True)
    top_ref = [r.argmax(-1) for r in ref]
    fp8_quality.ROWS.update({lb: (q, False) for lb, q in ROWS.items()})
    print("| weights | perplexity | vs float | KL to float (1e-3 nats/token) | top-1 agreement | bytes/weight held "
          "| quantise s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory(prefix="quantkit-fp4-bench-") as workdir:
        for label in labels:
            model, seconds = fp8_quality.build(label, model_path, calib, workdir)
            ppl, _, kl, lps = fp8_quality.perplexity(model, windows, False, ref, keep=True)
            agree = sum(int((lp.argmax(-1) == t).sum()) for lp, t in zip(lps, top_ref)) / sum(len(t) for t in top_ref)
            bpw = bytes_per_weight(model)
            cells = [label, f"{ppl:.3f}", "-" if ROWS[label] is None else f"{(ppl / base - 1) * 100:+.2f}%",
                     "-" if ROWS[label] is None else f"{kl * 1e3:.2f}", f"{agree:.1%}",
                     "-" if bpw is None else f"{bpw:.4f}", "-" if seconds is None else f"{seconds:.0f}"]
            print("| " + " | ".join(cells) + " |", flush=True)
            del model, lps
    print(f"\ncalibration: {calib_file.name}, {len(calib)} x 256 tokens; evaluation: eval_prose.txt, "
          f"{len(windows)} windows x 512 tokens")


if __name__ == "__main__":
    main()
