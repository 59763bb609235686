"""Perplexity against average bits per weight on the embedded SmolLM2-135M: W4/W3/W2 and --bits budgets.

    python bench/lowbit_frontier.py                  # every row (about 12 minutes on 2 idle CPU cores)
    python bench/lowbit_frontier.py --only "rtn|w3"  # rows whose label contains the text ('|' separates several)

Each row is a whole `quantkit quantize` job (quantize_to_checkpoint: the --bits allocation runs there), then
quantkit.load of the checkpoint and perplexity on bench/data/eval_prose.txt; bits per weight are `quantkit
inspect`'s (codes in int32 words plus every scale, over the quantised Linears; the float16 checkpoint's scales
are 16 bits). Calibration: 10 x 256 tokens of calibration/texts/prose_calib.txt (all it holds: 2671 tokens).
Writes docs/lowbit_frontier.png.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from quality_common import load_model, perplexity  # noqa: E402

SCHEMES = {"W4 g64": {"scheme": "w4a16", "group_size": 64}, "W4 g32": {"scheme": "w4a16", "group_size": 32},
           "W3 g64": {"scheme": "w3a16", "group_size": 64},
           "W3 g32": {"scheme": "w3a16", "group_size": 32}, "W2 g32": {"scheme": "w2a16", "group_size": 32},
           "--bits 3.5": {"bits": 3.5}, "--bits 4.5": {"bits": 4.5}}
ROWS = {f"{m.upper()} {s}": {**q, "method": m} for m in ("rtn", "gptq") for s, q in SCHEMES.items()}


def build(label: str, model_path: str, calib: str, workdir: str):
    from quantkit.inspect_ckpt import inspect_checkpoint
    from quantkit.job import quantize_to_checkpoint
    from quantkit.recipe import Recipe

    out = Path(workdir) / label.replace(" ", "_").replace("-", "")
    recipe = Recipe.model_validate({
        "model": model_path, "output": str(out), "overwrite": True, "device": "cpu", "quant": ROWS[label],
        "calibration": {"spec": calib, "num_samples": 10, "seq_len": 256, "seed": 0}})
    t0 = time.time()
    quantize_to_checkpoint(recipe)
    seconds = time.time() - t0
    info = inspect_checkpoint(out)
    widths = sorted({r["bits"] for r in info["layers"]})
    return out, info["average_bits_per_weight"], seconds, widths


def plot(points: dict[str, tuple[float, float]], base: float, path: Path) -> None:
    """Uniform widths as lines per method, --bits rows as open markers; rows above 10x float are off the scale."""
    from quantkit.evaluate.plot import _plt

    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    top = 10 * base
    for method, marker, color in (("RTN", "o", "C0"), ("GPTQ", "s", "C1")):
        rows = sorted((b, p, lb.split(" ", 1)[1]) for lb, (b, p) in points.items() if lb.startswith(method + " "))
        uniform = [r for r in rows if not r[2].startswith("--bits") and r[1] <= top]
        budget = [r for r in rows if r[2].startswith("--bits") and r[1] <= top]
        ax.plot([b for b, _, _ in uniform], [p for _, p, _ in uniform], marker=marker, color=color,
                label=f"{method}, uniform width")
        ax.scatter([b for b, _, _ in budget], [p for _, p, _ in budget], marker=marker, facecolors="none",
                   edgecolors=color, s=70, label=f"{method}, --bits")
        for b, p, name in uniform + budget:
            ax.annotate(name, (b, p), fontsize=7, xytext=(4, 4 if method == "RTN" else -10),
                        textcoords="offset points")
    off = sorted({lb.split(" ", 1)[1] for lb, (_, p) in points.items() if p > top})
    ax.axhline(base, color="gray", linestyle="--", label=f"float ({base:.2f})")
    ax.set_yscale("log")
    ax.set_xlabel("average bits per weight (scales included, quantised Linears)")
    ax.set_ylabel("perplexity, eval_prose.txt (log scale)")
    ax.set_title("SmolLM2-135M: quality per bit" + (f" ({', '.join(off)} off the scale)" if off else ""))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", help="rows whose label contains this (case-insensitive); '|' separates several")
    ap.add_argument("--max-windows", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--plot", default=str(HERE.parent / "docs" / "lowbit_frontier.png"))
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    from transformers import AutoTokenizer

    import quantkit
    from quantkit.data import load_eval_windows
    from quantkit.models.embedded import embedded_model_dir
    from quantkit.shipped import shipped_dir

    model_path = str(embedded_model_dir())
    tok = AutoTokenizer.from_pretrained(model_path)
    calib = str(shipped_dir("calibration") / "texts" / "prose_calib.txt")
    windows = list(load_eval_windows(str(HERE / "data" / "eval_prose.txt"), tok, seq_len=512,
                                     max_windows=a.max_windows))
    wanted = [w.strip().lower() for w in a.only.split("|")] if a.only else []
    labels = [lb for lb in ROWS if not wanted or any(w in lb.lower() for w in wanted)]
    base = perplexity(load_model(model_path), windows)
    print(f"float32: perplexity {base:.3f}\n")
    print("| method, weights | bits/weight | widths | perplexity | vs float | quantise s |")
    print("|---|---:|---|---:|---:|---:|")
    points = {}
    with tempfile.TemporaryDirectory(prefix="quantkit-lowbit-") as workdir:
        for label in labels:
            out, bpw, seconds, widths = build(label, model_path, calib, workdir)
            ppl = perplexity(quantkit.load(out, dtype=torch.float32, exact=True), windows)
            points[label] = (bpw, ppl)
            print(f"| {label} | {bpw:.3f} | {'/'.join(map(str, widths))} | {ppl:.2f} | {(ppl / base - 1) * 100:+.1f}% "
                  f"| {seconds:.0f} |", flush=True)
            if a.plot:  # redrawn after each row, so a run cut short still leaves its frontier
                plot(points, base, Path(a.plot))
    print(f"\ncalibration: prose_calib.txt, 10 x 256 tokens; evaluation: eval_prose.txt, {len(windows)} windows x 512 "
          "tokens")
    if a.plot:
        print(f"plot: {a.plot}")


if __name__ == "__main__":
    main()
