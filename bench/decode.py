"""Decode speed of the runtime next to the weight-reading limit and transformers' generate.

Usage: python bench/decode.py [--w4 CHECKPOINT] [--tokens 48] [--prompts 2] [--threads N] [--no-transformers]
The header names the CPU, its ISA flags, the caps in force (run under ATEN_CPU_CAPABILITY=avx2 or
ONEDNN_MAX_CPU_ISA=AVX2 ... to time another CPU kind) and the path the runtime measured fastest for each Linear
kind; below the table, W4 over float16 and W4's fraction of the read limit against issue 41's goals (1.8x, 50%),
eager and, with --compile, compiled (each W4 model against the float model run the same way).
Each run is appended to bench/out/decode-runs.json (machine, date, command, figures); bench/results/decode.json
is the harness's (`python -m bench decode`). main(argv) is callable.
Two limits, both bytes of weights read per token over a bandwidth measured in this run: the issue's, over the
copy bandwidth counted as bytes copied per second (a 512 MB tensor copy; the issue's "limit near 23 tok/s" for
538 MB is this one), and a stricter one over the read bandwidth (a sum over 512 MB: a decode step reads its
weights and writes next to nothing), which on this machine is about twice the copy rate. "transformers" is the
checkpoint loaded by transformers itself (compressed-tensors dequantises it to float32 on a CPU) and decoded by
its plain generate, what a user without quantkit runs; "transformers, our modules" is generate over the model quantkit loaded.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from common import (copy_bandwidth, decode_hf, decode_ours, half_weights, prompt_ids, read_bandwidth,  # noqa: E402
                    weight_bytes_per_token)
import quantkit  # noqa: E402
from quantkit.kernels import path_choice  # noqa: E402
from quantkit.linear.dispatch import kernel_paths  # noqa: E402
from quantkit.runtime import build  # noqa: E402
from quantkit.runtime.sampling import SamplingParams  # noqa: E402


RESULTS = Path(__file__).resolve().parent / "out" / "decode-runs.json"
FLOAT16, W4 = "float (fp16 weights, fp32 products)", "w4a16"
RATIO_GOAL, LIMIT_GOAL = 1.8, 0.5  # issue 41: W4 at least 1.8x float16 decode and half the read limit


def ours(model, prompts, n):
    return decode_ours(model, prompts, SamplingParams(max_tokens=n, ignore_eos=True), 1, None, set())[0]


def hf(model, prompts, n):
    return decode_hf(model, prompts, n, min_new_tokens=n)[0]


def transformers_model(path: str):
    from transformers import AutoModelForCausalLM

    from quantkit.models.embedded import embedded_model_dir

    src = str(embedded_model_dir()) if path == "embedded" else path
    kw = {}
    if path != "embedded":
        from transformers import CompressedTensorsConfig

        # dequantised once at load: faster on a CPU than its default compressed modules, which decompress the
        # weights in every forward, so the comparison is against transformers' better option
        kw["quantization_config"] = CompressedTensorsConfig(dequantize=True)
    return AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, **kw).eval()


def machine_header(fields: dict) -> list[str]:
    """What the figures were measured on: CPU model, ISA flags, the caps in force."""
    caps = ", ".join(f"{k}={v}" for k, v in fields["caps"].items()) or "none (the CPU's full ISA)"
    return [f"CPU: {fields['cpu']}; ISA flags: {' '.join(fields['isa'])}",
            f"torch {fields['torch']}, ATen capability {fields['capability']}; caps in force: {caps}; "
            f"{fields['threads']} threads; load average before: {fields.get('load_average_before', '?')}"]


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def record(result: dict, path: Path) -> None:
    """Add this run to the JSON file (one entry per run: machine, date, command, figures)."""
    runs = []
    try:
        old = json.loads(path.read_text())
        runs = old["runs"] if isinstance(old, dict) and isinstance(old.get("runs"), list) else []
    except (OSError, ValueError):
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"runs": runs + [result]}, indent=1) + "\n")


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--w4", help="W4 checkpoint folder (quantkit demo -o DIR, or quantize ... --scheme w4a16)")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    ap.add_argument("--compile", action="store_true", help="also time each model with --compile (torch.compile)")
    ap.add_argument("--float32-weights", action="store_true",
                    help="also time the float model with its weights held in float32 (oneDNN's layout), as before "
                         "the runtime held float16 checkpoints' weights in float16 (FBGEMM)")
    ap.add_argument("--no-transformers", action="store_true", help="leave out transformers' generate (faster)")
    ap.add_argument("--json", type=Path, default=RESULTS, help=f"append the run here (default {RESULTS})")
    return ap.parse_args(argv)


def time_variant(name, path, hold_half, prompts, a, bw, copy_bw, rows):
    with half_weights(hold_half):
        model = quantkit.load(path, dtype=torch.float32)
    paths = kernel_paths(model)[1:]
    wb = weight_bytes_per_token(model)  # before compiling: the compiled forward holds the same tensors
    if name.endswith("--compile") and not build.compile_decode(model):
        print(f"{name}: stays eager (FBGEMM / oneDNN products; build.compile_decode), row left out")
        return None
    ours(model, prompts[:1], 4)  # warm-up (and, compiled, the compilation)
    o = ours(model, prompts, a.tokens)
    h = h_ours = None
    if name.endswith("--compile"):
        h = rows[-1]["transformers_tok_s"] if rows else None  # generate would only recompile for its own calls
    elif not a.no_transformers:
        h_ours = hf(model, prompts, a.tokens)
        plain = transformers_model(path)
        h = hf(plain, prompts, a.tokens)
        del plain
    del model
    return {"model": name, "weight_mb_per_token": wb / 1e6, "tok_s": o, "limit_copy_tok_s": copy_bw / 2 / wb,
            "limit_read_tok_s": bw / wb, "read_limit_fraction": o / (bw / wb), "transformers_tok_s": h,
            "transformers_our_modules_tok_s": h_ours, "paths": paths}


def print_table(result: dict) -> None:
    print("\n".join(machine_header(result["machine"])))
    for r in result["rows"]:
        print(f"chosen paths, {r['model']}:" + "".join(f"\n  {line}" for line in r["paths"]))
    print(f"read bandwidth {result['read_gb_s']:.1f} GB/s, copy bandwidth (read + write) {result['copy_gb_s']:.1f} "
          f"GB/s, {result['prompts']} prompts x {result['tokens']} tokens, greedy, decode only")
    print("| model | weight MB/token | quantkit tok/s | limit tok/s (copy) | % of copy limit | limit tok/s (read) | "
          "% of read limit | transformers tok/s | speed-up | transformers, our modules tok/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    fmt = lambda v: "-" if v is None else format(v, ".1f")  # noqa: E731
    for r in result["rows"]:
        o, h = r["tok_s"], r["transformers_tok_s"]
        print(f"| {r['model']} | {r['weight_mb_per_token']:.0f} | {o:.1f} | {r['limit_copy_tok_s']:.1f} | "
              f"{100 * o / r['limit_copy_tok_s']:.0f}% | {r['limit_read_tok_s']:.1f} | "
              f"{100 * r['read_limit_fraction']:.0f}% | {fmt(h)} | {'-' if h is None else format(o / h, '.2f') + 'x'} | "
              f"{fmt(r['transformers_our_modules_tok_s'])} |")
    for how, g in (result.get("goals") or {}).items():
        print(f"{how}: W4 / float16: {g['w4_over_float16']:.2f}x (goal >= {RATIO_GOAL}x: "
              f"{'met' if g['ratio_met'] else 'NOT met'}); W4 at {100 * g['w4_read_limit_fraction']:.0f}% of the read "
              f"limit (goal >= {100 * LIMIT_GOAL:.0f}%: {'met' if g['limit_met'] else 'NOT met'})")


def main(argv=None) -> dict:
    """Time the variants, print the table, append the run to --json; returns the run's record."""
    a = parse(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    fields = path_choice.machine()  # after --threads: the thread count is part of what the choice depends on
    load_before = load_average()
    tok = build.load_tokenizer("embedded")
    prompts = prompt_ids(tok, "open_prose", a.prompts)
    bw, copy_bw = read_bandwidth(), copy_bandwidth()
    rows = []
    # the float model is SmolLM2 as stored (float16) run in float32: the runtime holds its weights in float16 and
    # multiplies in float32 (linear/half_weight.py), transformers holds them in float32
    variants = [(FLOAT16, "embedded", True)]
    if a.float32_weights:
        variants.append(("float (fp32 weights, oneDNN)", "embedded", False))
    if a.w4:
        variants.append((W4, a.w4, True))
    if a.compile:
        variants = [(n + c, p, h) for n, p, h in variants for c in ("", " --compile")]
    with torch.inference_mode():
        for name, path, hold_half in variants:
            row = time_variant(name, path, hold_half, prompts, a, bw, copy_bw, rows)
            if row is not None:
                rows.append(row)
    result = {"machine": {**fields, "load_average_before": load_before, "load_average_after": load_average()},
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["python", "bench/decode.py", *(sys.argv[1:] if argv is None else argv)]),
              "read_gb_s": bw / 1e9, "copy_gb_s": copy_bw / 1e9, "prompts": a.prompts, "tokens": a.tokens,
              "rows": rows}
    by = {r["model"]: r for r in rows}
    for how, suffix in (("eager", ""), ("compiled", " --compile")):  # W4 against float run the same way
        w4, f16 = by.get(W4 + suffix), by.get(FLOAT16 + suffix)
        if w4 and f16:
            ratio, frac = w4["tok_s"] / f16["tok_s"], w4["read_limit_fraction"]
            result.setdefault("goals", {})[how] = {"w4_over_float16": ratio, "ratio_met": ratio >= RATIO_GOAL,
                                                   "w4_read_limit_fraction": frac, "limit_met": frac >= LIMIT_GOAL}
    print_table(result)
    if a.json:
        record(result, a.json)
    return result


if __name__ == "__main__":
    main()
