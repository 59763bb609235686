"""Quantise the embedded SmolLM2-135M-Instruct every way quantkit supports and compare them with `run_eval`.

Usage: python bench/eval_smollm.py [--out bench/out/eval_smollm] [--per-task 20] [--windows 8]

Text: the Python language reference shipped inside CPython (pydoc_data.topics), since hub datasets cannot be
fetched here; GPTQ/AWQ/FP8-KV calibrate on one half of its topics and perplexity is measured on the other.
Checkpoints already in OUT/checkpoints are reused unless --fresh is given.
Tasks: calibration/tasks/eval_tasks.jsonl, the first --per-task items of each task label. Variants that fail
to quantise or load are listed as skipped with the reason; the table is printed and written to OUT/report.md.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from quantkit.shipped import shipped_dir

ROOT = Path(__file__).resolve().parents[1]

VARIANTS = [  # label, recipe overrides
    ("w8a16", {"quant.scheme": "w8a16", "quant.method": "rtn"}),
    ("w4a16-rtn", {"quant.scheme": "w4a16", "quant.method": "rtn", "quant.group_size": 64}),
    ("w4a16-gptq", {"quant.scheme": "w4a16", "quant.method": "gptq", "quant.group_size": 64}),
    ("w4a16-awq", {"quant.scheme": "w4a16", "quant.method": "awq", "quant.group_size": 64}),
    ("fp8", {"quant.scheme": "fp8", "quant.method": "rtn"}),
    ("fp8-kv", {"quant.scheme": "fp8", "quant.method": "rtn", "quant.kv_cache": "fp8"}),
]


def _text_files(out: Path) -> tuple[Path, Path]:
    """Calibration text and perplexity text: disjoint halves of the topics (sorted by name)."""
    import pydoc_data.topics as topics

    keys = sorted(topics.topics)
    half = len(keys) // 2
    calib, held = out / "calib_text.txt", out / "eval_text.txt"
    calib.write_text("\n\n".join(topics.topics[k] for k in keys[:half]))
    held.write_text("\n\n".join(topics.topics[k] for k in keys[half:]))
    return calib, held


def _task_subset(per_task: int, path: Path) -> Path:
    seen: dict[str, int] = {}
    keep = []
    for line in (shipped_dir("calibration") / "tasks" / "eval_tasks.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if seen.get(rec["task"], 0) < per_task:
            seen[rec["task"]] = seen.get(rec["task"], 0) + 1
            keep.append(line)
    path.write_text("\n".join(keep) + "\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "bench/out/eval_smollm"))
    ap.add_argument("--per-task", type=int, default=20)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=10)
    ap.add_argument("--calib-samples", type=int, default=32)
    ap.add_argument("--only", default="", help="comma list of variant labels")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--fresh", action="store_true", help="re-quantise even when a checkpoint exists")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: small models on a shared CPU)")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)

    from rich.console import Console

    from quantkit.evaluate import run_eval
    from quantkit.evaluate.report import print_tables
    from quantkit.models.embedded import embedded_model_dir
    from quantkit.job import quantize_to_checkpoint
    from quantkit.recipe import Recipe, apply_overrides
    from quantkit import load

    out = Path(args.out)
    ckpts = out / "checkpoints"
    ckpts.mkdir(parents=True, exist_ok=True)
    base = embedded_model_dir()
    calib_text, eval_text = _text_files(out)
    made, skipped = [], {}
    only = set(filter(None, args.only.split(",")))
    for label, over in VARIANTS:
        if only and label not in only:
            continue
        t0 = time.time()
        if not args.fresh and (ckpts / label / "config.json").is_file():
            made.append(f"{label}={ckpts / label}")
            print(f"reusing {ckpts / label}")
            continue
        try:
            r = apply_overrides(Recipe(), {"model": str(base), "output": str(ckpts / label), "overwrite": True,
                                           "calibration.spec": str(calib_text),
                                           "calibration.num_samples": args.calib_samples,
                                           "calibration.seq_len": args.seq_len, **over})
            quantize_to_checkpoint(r)
            load(ckpts / label, device=args.device, exact=True)  # a checkpoint the runtime cannot load is reported, not run
            made.append(f"{label}={ckpts / label}")
            print(f"quantised {label} in {time.time() - t0:.0f} s", flush=True)
        except Exception as e:  # noqa: BLE001 - a bench lists what failed and goes on with the rest
            skipped[label] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            print(f"skipped {label}: {skipped[label]}")
    t0 = time.time()
    report = run_eval(f"fp16-base={base}", made, data=str(eval_text),
                      tasks=str(_task_subset(args.per_task, out / "tasks.jsonl")), out_dir=out,
                      seq_len=args.seq_len, max_windows=args.windows, max_new_tokens=args.max_new_tokens,
                      device=args.device, log=print)
    print(f"eval: {time.time() - t0:.0f} s")
    print_tables(report, Console(width=220))
    if skipped:
        print("skipped:", json.dumps(skipped, indent=1))
        with open(out / "report.md", "a") as fh:
            fh.write("\nSkipped variants:\n\n" + "".join(f"- {k}: {v}\n" for k, v in skipped.items()))


if __name__ == "__main__":
    main()
