"""Quality benchmark: perplexity, quantisation wall time and peak RSS of each method on the embedded SmolLM2-135M.

    python bench/quality.py                      # every row (about 10 minutes on 2 CPU cores)
    python bench/quality.py --only "W4 g64"      # rows whose "scheme / method" label contains the text
    python bench/quality.py --llmcompressor-python /tmp/venv/bin/python   # add llm-compressor's GPTQ and AWQ rows

Calibration tokens (default: text sampled from the model itself, the CLI's default) and evaluation windows (prose
written for this benchmark, bench/data/eval_prose.txt, so disjoint from any calibration source) are made once and
shared by every row, as are the float model's greedy tokens on those windows (the agreement column). Each row runs
in its own process so that its peak RSS is its own; peak RSS includes loading the float32 model. Methods are data:
a new solver adds an entry to METHODS.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from quality_common import load_model, peak_rss_mb, reset_peak_rss, score, write_result  # noqa: E402


# label -> recipe fields (dotted, as quantkit.recipe.apply_overrides takes them)
SCHEMES: dict[str, dict] = {
    # SmolLM2's 576-wide projections do not divide by 128, hence group 64
    "W4 g64": {"quant.scheme": "w4a16", "quant.group_size": 64, "quant.symmetric": True},
    "W8 channel": {"quant.scheme": "w8a16", "quant.group_size": -1, "quant.symmetric": True},
}


@dataclass
class Method:
    label: str
    runner: str  # "float" (no quantisation), "quantkit" or "llmcompressor"
    options: dict = field(default_factory=dict)  # recipe fields (quantkit) or the runner's own knobs
    schemes: tuple[str, ...] = tuple(SCHEMES)


METHODS: list[Method] = [
    Method("float32 (no quantisation)", "float", schemes=("-",)),
    Method("RTN", "quantkit", {"quant.method": "rtn"}),
    Method("GPTQ", "quantkit", {"quant.method": "gptq"}),
    Method("GPTQ act-order weight", "quantkit", {"quant.method": "gptq", "quant.gptq.actorder": "weight"}),
    # AWQ pays off at 4 bits; at 8 bits RTN is already near float
    Method("AWQ", "quantkit", {"quant.method": "awq"}, schemes=("W4 g64",)),
    Method("AWQ+GPTQ", "quantkit", {"quant.method": "awq+gptq"}, schemes=("W4 g64",)),
    Method("llm-compressor GPTQ", "llmcompressor", {"actorder": None}),
    # llm-compressor's default act-order ("static"), which is our "weight"
    Method("llm-compressor GPTQ act-order weight", "llmcompressor", {"actorder": "weight"}, schemes=("W4 g64",)),
    # its AWQModifier with its defaults (duo scaling, 20-point grid), then its round-to-nearest or its GPTQ
    Method("llm-compressor AWQ", "llmcompressor", {"algo": "awq"}, schemes=("W4 g64",)),
    Method("llm-compressor AWQ+GPTQ", "llmcompressor", {"algo": "awq+gptq"}, schemes=("W4 g64",)),
]


@dataclass
class Row:
    scheme: str
    method: Method

    @property
    def label(self) -> str:
        return f"{self.scheme} / {self.method.label}"


def rows(only: str | None) -> list[Row]:
    order = ["-", *SCHEMES]
    out = [Row(s, m) for s in order for m in METHODS if s in m.schemes]
    # the float row always runs: every other row is measured against it
    return [r for r in out if not only or r.method.runner == "float" or only.lower() in r.label.lower()]


# ------------------------------------------------------------------------------------------------ workers


def run_worker(row: dict, model_path: str, tokens_path: str, out_path: str) -> None:
    import torch

    data = torch.load(tokens_path)
    method = Method(**row["method"])
    model = load_model(model_path)
    result = {"load_rss_mb": peak_rss_mb()}
    # from here the peak is the quantisation's own (with the float model resident), not the load's
    result["peak_reset"] = reset_peak_rss()
    if method.runner == "quantkit":
        from quantkit.pipeline import quantize_model
        from quantkit.plan import build_plan
        from quantkit.recipe import Recipe, apply_overrides

        recipe = apply_overrides(Recipe(), {**SCHEMES[row["scheme"]], **method.options})
        t, c = time.perf_counter(), time.process_time()
        res = quantize_model(model, build_plan(model, recipe), data["calib"])
        result["quant_seconds"] = time.perf_counter() - t
        result["quant_cpu_seconds"] = time.process_time() - c
        result["peak_rss_mb"] = peak_rss_mb()
        errs = [s["output_rel_error"] for s in res.stats.values() if s.get("output_rel_error") is not None]
        result["mean_output_rel_error"] = sum(errs) / len(errs) if errs else None
        result["fallbacks"] = sum(1 for s in res.stats.values() if s.get("fallback"))
    s = score(model, data["eval"], data["ref_top1"])
    result["ppl"], result["agreement"] = s["ppl"], s["agreement"]
    write_result(out_path, result)


def spawn(row: Row, model_path: str, tokens_path: str, workdir: str, ext_python: str | None,
          threads: int | None) -> dict:
    out = os.path.join(workdir, f"row{abs(hash(row.label))}.json")
    spec = json.dumps({"scheme": row.scheme, "method": asdict(row.method)})
    if row.method.runner == "llmcompressor":
        if not ext_python:
            return {"skipped": "no --llmcompressor-python given"}
        cmd = [ext_python, str(HERE / "quality_llmcompressor.py"), "--row", spec, "--scheme-fields",
               json.dumps(SCHEMES[row.scheme])]
    else:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", spec]
    cmd += ["--model", model_path, "--tokens", tokens_path, "--out", out]
    if threads:
        cmd += ["--threads", str(threads)]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"error": " | ".join(tail)[-300:]}
    with open(out) as f:
        res = json.load(f)
    res["process_seconds"] = time.perf_counter() - t
    return res


# ------------------------------------------------------------------------------------------------ table


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(results: list[tuple[Row, dict]], meta: dict) -> str:
    base = next((r["ppl"] for row, r in results if row.method.runner == "float" and "ppl" in r), None)
    # CPU seconds of the quantising process next to wall seconds: on a shared machine wall time depends on the
    # neighbours, CPU time (with --threads 1) much less
    lines = ["| scheme | method | perplexity | vs float | top-1 agreement | quantise wall s | quantise CPU s | "
             "load peak MiB | quantise peak MiB | mean layer out err |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row, r in results:
        if "ppl" not in r:
            lines.append(f"| {row.scheme} | {row.method.label} | {r.get('error') or r.get('skipped')} | | | | | | | |")
            continue
        delta = None if base is None else (r["ppl"] / base - 1) * 100
        vs = "-" if delta is None or row.method.runner == "float" else f"{delta:+.1f}%"
        agree = r.get("agreement")
        cells = [row.scheme, row.method.label, f"{r['ppl']:.3f}", vs,
                 "-" if agree is None else f"{agree * 100:.1f}%", fmt(r.get("quant_seconds"), ".1f"),
                 fmt(r.get("quant_cpu_seconds"), ".1f"), fmt(r.get("load_rss_mb"), ".0f"),
                 fmt(r.get("peak_rss_mb") if r.get("peak_reset") else None, ".0f"),
                 fmt(r.get("mean_output_rel_error"), ".4f")]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(f"calibration: {meta['calib']}; evaluation: {meta['eval']}; top-1 agreement: teacher-forced "
                 "argmax equal to the float32 model's at every position of the evaluation windows; quantise peak: highest RSS "
                 "while quantising, the float32 model included (the peak is reset after loading)")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=32, help="calibration samples")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per calibration sample")
    ap.add_argument("--calib", default="self", help="calibration spec (quantkit.data.load_calibration)")
    ap.add_argument("--eval", default=str(HERE / "data" / "eval_prose.txt"), help="evaluation text spec")
    ap.add_argument("--eval-seq-len", type=int, default=512)
    ap.add_argument("--max-windows", type=int, default=16)
    ap.add_argument("--only", help="run rows whose 'scheme / method' label contains this")
    ap.add_argument("--llmcompressor-python", default=os.environ.get("QUANTKIT_BENCH_LLMCOMPRESSOR_PYTHON"),
                    help="python of a venv with llmcompressor installed (rows are skipped without it)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads per process (1 avoids spin-waiting when other jobs share the cores)")
    ap.add_argument("--json", help="also write the raw results here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--tokens", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    if a.worker:
        return run_worker(json.loads(a.worker), a.model, a.tokens, a.out)

    import torch
    from transformers import AutoTokenizer

    from quantkit.data import load_calibration, load_eval_windows
    from quantkit.models.embedded import embedded_model_dir

    model_path = str(embedded_model_dir())
    tok = AutoTokenizer.from_pretrained(model_path)
    t = time.perf_counter()
    model = load_model(model_path)
    calib = load_calibration(spec=a.calib, tokenizer=tok, num_samples=a.samples, seq_len=a.seq_len, seed=0,
                             model=model if a.calib == "self" else None)
    windows = load_eval_windows(a.eval, tok, seq_len=a.eval_seq_len, max_windows=a.max_windows)
    # the float model's greedy tokens on the evaluation windows, which every row's agreement is counted against
    ref_top1 = score(model, list(windows))["top1"]
    del model
    meta = {"calib": f"{a.calib}, {len(calib)} x {a.seq_len} tokens (made in {time.perf_counter() - t:.0f} s)",
            "eval": f"{Path(a.eval).name}, {len(windows)} windows x {a.eval_seq_len} tokens"}
    results = []
    with tempfile.TemporaryDirectory(prefix="quantkit-bench-") as workdir:
        tokens_path = os.path.join(workdir, "tokens.pt")
        torch.save({"calib": list(calib.samples), "eval": list(windows), "ref_top1": ref_top1}, tokens_path)
        for row in rows(a.only):
            r = spawn(row, model_path, tokens_path, workdir, a.llmcompressor_python, a.threads)
            print(f"{row.label}: {json.dumps(r)}", file=sys.stderr, flush=True)
            results.append((row, r))
    print(table(results, meta))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "rows": [{"label": row.label, **r} for row, r in results]}, f, indent=1)


if __name__ == "__main__":
    main()
