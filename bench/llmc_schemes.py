"""llm-compressor's W8A8 INT8 and FP4-weight rows beside quantkit's in bench/w8a8_quality.py's and
bench/fp4_quality.py's tables: the same embedded SmolLM2-135M, calibration tokens, evaluation windows and scoring
code, with llm-compressor (in its own venv, bench/llmc_schemes_worker.py) writing each checkpoint.

    python bench/llmc_schemes.py --table w8a8              # every W8A8 row (needs .venv-llmc)
    python bench/llmc_schemes.py --table fp4 --only gptq   # FP4 rows whose label contains the text
    python bench/llmc_schemes.py --table w8a8 --llmc-python /path/to/venv/bin/python --json rows.json

Each checkpoint is reloaded here through transformers + compressed-tensors in float32 and scored by the table's
own function (w8a8_quality.evaluate; fp8_quality.perplexity as fp4_quality.py calls it). W8A8 loads on
transformers' default compressed path, which quantises activations in each Linear's forward; FP4A16 (weights
only) loads with dequantize=True, since the default path decompresses FP4 to bfloat16, which a float32 model
refuses. The worker also scores its in-memory model before saving; the row reports both perplexities, so a
reload that lost part of the arithmetic (activation quantisation, say) shows as a mismatch.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import fp8_quality  # noqa: E402
import w8a8_quality  # noqa: E402
from quality_common import load_model  # noqa: E402

# label -> (scheme for the worker, "rtn" or "gptq", SmoothQuant smoothing_strength or None[, also smooth down_proj])
ROWS = {
    "w8a8": {
        "W8A8 RTN": ("W8A8", "rtn", None),
        "W8A8 GPTQ": ("W8A8", "gptq", None),
        "W8A8 + SmoothQuant 0.5 RTN": ("W8A8", "rtn", 0.5),
        "W8A8 + SmoothQuant 0.5 GPTQ": ("W8A8", "gptq", 0.5),
        "W8A8 + SmoothQuant 0.8 GPTQ": ("W8A8", "gptq", 0.8),
        "W8A8-static + SmoothQuant 0.8 GPTQ": ("W8A8-static", "gptq", 0.8),
        "W8A8 + SmoothQuant 0.5 RTN, down_proj smoothed too": ("W8A8", "rtn", 0.5, True),
        "W8A8 + SmoothQuant 0.5 GPTQ, down_proj smoothed too": ("W8A8", "gptq", 0.5, True),
    },
    "fp4": {
        "NVFP4A16 RTN": ("NVFP4A16", "rtn", None),
        "NVFP4A16 GPTQ": ("NVFP4A16", "gptq", None),
        "MXFP4A16 RTN": ("MXFP4A16", "rtn", None),
        "MXFP4A16 GPTQ": ("MXFP4A16", "gptq", None),
    },
}


def default_llmc_python() -> str | None:
    # bench/quality.py's convention (the env variable), else the gitignored side venv at the repository root
    env = os.environ.get("QUANTKIT_BENCH_LLMCOMPRESSOR_PYTHON")
    local = HERE.parent / ".venv-llmc" / "bin" / "python"
    return env or (str(local) if local.exists() else None)


def run_worker(llmc_python: str, row: tuple, model_path: str, tokens: str, save: str, threads: int) -> dict:
    scheme, algo, smooth, down = (*row, False)[:4]
    out = save + ".json"
    cmd = [llmc_python, str(HERE / "llmc_schemes_worker.py"), "--scheme", scheme, "--algo", algo,
           "--model", model_path, "--tokens", tokens, "--save", save, "--out", out, "--threads", str(threads)]
    if smooth is not None:
        cmd += ["--smooth", str(smooth)] + (["--smooth-down"] if down else [])
    # one thread for OpenMP too, so the worker does not spin on cores other jobs share
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    if proc.returncode != 0:
        tail = [ln for ln in (proc.stderr or proc.stdout).strip().splitlines() if ln.strip()][-3:]
        return {"error": " | ".join(tail)[-400:]}
    with open(out) as f:
        return json.load(f)


def load_checkpoint(path: str, weights_only: bool):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    kw = {"quantization_config": CompressedTensorsConfig(dequantize=True)} if weights_only else {}
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw).eval()


def bits_per_weight(path: str) -> float:
    """Bits the checkpoint stores per quantised weight: every tensor of a Linear that has weight_packed (codes,
    group scales, global scale), over the weights they stand for (two FP4 codes per byte)."""
    from safetensors import safe_open

    stored, weights = 0, 0
    for file in Path(path).glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            keys = set(f.keys())
            for k in [k for k in keys if k.endswith(".weight_packed")]:
                prefix = k[: -len("weight_packed")]
                for name in [n for n in keys if n.startswith(prefix + "weight")]:
                    t = f.get_tensor(name)
                    stored += t.numel() * t.element_size()
                weights += f.get_slice(k).get_shape()[0] * f.get_slice(k).get_shape()[1] * 2
    return stored * 8 / weights


def score_w8a8(model, windows, ref, base, label, r) -> str:
    ppl, kl, agree, _ = w8a8_quality.evaluate(model, windows, ref)
    r.update(ppl=ppl, kl=kl, agreement=agree)
    return (f"| {label} | {ppl:.3f} | {(ppl / base - 1) * 100:+.2f}% | {kl * 1e3:.2f} | {agree * 100:.1f}% | "
            f"{r['smooth']} | {r['quant_seconds']:.0f} |")


def score_fp4(model, windows, ref, base, label, r, path) -> str:
    ppl, _, kl, lps = fp8_quality.perplexity(model, windows, False, ref, keep=True)
    top_ref = [x.argmax(-1) for x in ref]
    agree = sum(int((lp.argmax(-1) == t).sum()) for lp, t in zip(lps, top_ref)) / sum(len(t) for t in top_ref)
    bits = bits_per_weight(path)
    r.update(ppl=ppl, kl=kl, agreement=agree, bits_per_weight=bits)
    return (f"| {label} | {bits:.4g} | {ppl:.3f} | {(ppl / base - 1) * 100:+.2f}% | {kl * 1e3:.2f} | "
            f"{agree * 100:.1f}% | {r['quant_seconds']:.0f} |")


def reference(table: str, model_path: str, windows) -> tuple[float, list]:
    """The float model's perplexity and per-window log-probs, by the table's own scoring function."""
    if table == "w8a8":
        base, _, _, ref = w8a8_quality.evaluate(load_model(model_path), windows)
    else:
        base, _, _, ref = fp8_quality.perplexity(load_model(model_path), windows, False, keep=True)
    return base, ref


def run_row(table, label, row, ctx, workdir) -> dict:
    save = os.path.join(workdir, "".join(c if c.isalnum() else "_" for c in label))
    r = run_worker(ctx["llmc"], row, ctx["model_path"], ctx["tokens"], save, ctx["threads"])
    r.update(label=f"llm-compressor {r.get('llmcompressor', '?')} {label}", table=table, scheme=row[0],
             algo=row[1], smooth="none" if row[2] is None else f"{row[2]} (fixed)")
    if "error" in r:
        r["line"] = f"| {r['label']} | {r['error']} |"
        return r
    model = load_checkpoint(save, weights_only=table == "fp4")
    if table == "w8a8":
        line = score_w8a8(model, ctx["windows"], ctx["ref"], ctx["base"], r["label"], r)
    else:
        line = score_fp4(model, ctx["windows"], ctx["ref"], ctx["base"], r["label"], r, save)
    r["line"] = line
    return r


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], add_help=False)
    ap.add_argument("--table", choices=sorted(ROWS), required=True)
    ap.add_argument("--llmc-python", default=default_llmc_python())
    ap.add_argument("--json", help="append each row's raw result here (one JSON object a line)")
    ours, rest = ap.parse_known_args(argv)
    # the calibration/evaluation options (and --only, --threads) are the quantkit benches' own, same defaults
    a = fp8_quality.text_args(__doc__.split("\n")[0], rest)
    if not ours.llmc_python:
        raise SystemExit("no llm-compressor venv: make .venv-llmc or set QUANTKIT_BENCH_LLMCOMPRESSOR_PYTHON")
    model_path, calib, windows = fp8_quality.load_texts(a)
    wanted = [w.strip().lower() for w in a.only.split("|")] if a.only else []
    labels = [lb for lb in ROWS[ours.table] if not wanted or any(w in lb.lower() for w in wanted)]
    base, ref = reference(ours.table, model_path, windows)
    print(f"float32 perplexity {base:.3f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="quantkit-llmc-bench-") as workdir:
        tokens = os.path.join(workdir, "tokens.pt")
        torch.save({"calib": list(calib), "eval": list(windows)}, tokens)
        ctx = {"llmc": ours.llmc_python, "model_path": model_path, "tokens": tokens, "threads": a.threads,
               "windows": windows, "ref": ref, "base": base}
        for label in labels:
            r = run_row(ours.table, label, ROWS[ours.table][label], ctx, workdir)
            print(r["line"], f"(in-memory ppl {r.get('in_memory_ppl', float('nan')):.3f})", flush=True)
            if ours.json:
                with open(ours.json, "a") as f:
                    f.write(json.dumps(r) + "\n")
    print(f"\ncalibration: {Path(a.calib).name}, {len(calib)} x {a.seq_len} tokens; evaluation: "
          f"{Path(a.eval).name}, {len(windows)} windows x {a.eval_seq_len} tokens")


if __name__ == "__main__":
    main()
