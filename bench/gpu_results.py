"""The device run's logs as bench results: what bench/gpu_check.sh (and bench/gpu_smollm.py) printed on the GPU,
parsed into bench/results/gpu_kernels.json and gpu_checks.json, from which `python -m bench report` writes the GPU
sections of docs/benchmarks.md. The logs come back from the device machine; nothing here needs a GPU.

    python bench/gpu_results.py --date "2026-12-04 16:59-17:12 UTC" --gpu "NVIDIA H200" [--kernel-log LOG] LOG...
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
KERNEL_ROW = re.compile(r"^\| (\d+x\d+) \| (\d+) \| ([^|]+?) \| ([\d.]+) \| (\d+) \| (\d+)% \| ([\d.]+)x \| \w+ \|$")
DECODE_ROW = re.compile(r"^\| ([^|]+?) \| (cuda|cpu) \| ([\d.]+) \| ([\d.]+) \| (\d+)% \|$")
STEP = re.compile(r"^=== (?!rc=)(.+?)(?: \(limit \d+s\))?$")
STEP_END = re.compile(r"^=== (?:.*: )?rc=(\d+) in (\d+)s")
PYTEST = re.compile(r"^(?:(\d+) failed, )?(\d+) passed")
SHOWN_ROWS = (1, 4, 64)  # batch-1 decode, the GEMV's widest, the tensor-core GEMM's widest
COPY = re.compile(r"^copy bandwidth: (\d+) GB/s")


def parse(lines: list[str]) -> tuple[list[dict], list[dict], float | None]:
    """(kernel rows, check rows, copy bandwidth GB/s) from one or more logs' lines."""
    kernels, checks, copy_bw, step = [], [], None, None
    for line in lines:
        line = line.rstrip("\n")
        if m := COPY.match(line):
            copy_bw = float(m[1])
        elif m := KERNEL_ROW.match(line):
            kernels.append({"in x out": m[1], "rows": int(m[2]), "kernel": m[3], "us": float(m[4]),
                            "GB/s": float(m[5]), "of measured copy": f"{m[6]}%", "vs cuBLAS fp16": f"{m[7]}x"})
        elif m := DECODE_ROW.match(line):
            checks.append({"check": f"decode SmolLM2-135M batch 1: {m[1]} on {m[2]}",
                           "result": f"{m[3]} tok/s, {m[4]} ms/token, greedy tokens as float16 {m[5]}%"})
        elif line.startswith(("PASS ", "FAIL ")):
            checks.append({"check": line[5:].split(":")[0], "result": line[:4] + ":" + line[5:].split(":", 1)[-1]})
        elif line.startswith("info: "):
            checks.append({"check": line[6:].split(":")[0], "result": "info:" + line[6:].split(":", 1)[-1]})
        elif m := PYTEST.match(line):
            checks.append({"check": f"pytest: {step or 'tests'}",
                           "result": f"{'FAIL' if m[1] else 'PASS'}: {line.strip()}"})
        elif m := STEP_END.match(line):
            if m[1] == "124":
                checks.append({"check": f"step: {step}", "result": f"FAIL: stopped at its time limit ({m[2]} s)"})
        elif m := STEP.match(line):
            step = m[1]
    return kernels, checks, copy_bw


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="device-run logs -> bench/results/gpu_*.json",
                                 epilog="example: python bench/gpu_results.py --date '2026-12-04 17:03 UTC' "
                                        "--gpu 'NVIDIA H200' gpu_check.log")
    ap.add_argument("logs", nargs="+", help="logs whose checks and kernel rows are taken")
    ap.add_argument("--kernel-log", action="append", default=[],
                    help="a log taken for its kernel table only (an earlier run's checks superseded by LOGS)")
    ap.add_argument("--date", required=True)
    ap.add_argument("--gpu", required=True)
    ap.add_argument("--torch", default="2.11.0+cu130")
    ap.add_argument("--command", default="bash bench/gpu_check.sh")
    ap.add_argument("--note", default="")
    ap.add_argument("--checks-note", default="")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    def read(paths):
        return [line for path in paths for line in Path(path).read_text(errors="replace").splitlines()]

    kernels, checks, copy_bw = parse(read(args.logs))
    if args.kernel_log:
        kernels, _, copy_bw = parse(read(args.kernel_log))
    kernels = [k for k in kernels if k["rows"] in SHOWN_ROWS]
    if not kernels and not checks:
        print(f"no gpu_check output found in {', '.join(args.logs)}", file=sys.stderr)
        return 2
    machine = {"cpu": "the device machine's host (x86-64, 16 cores)", "gpu": args.gpu, "torch": args.torch}
    base = {"command": args.command, "machine": machine, "date": args.date}
    out = Path(args.out)
    copy_note = f"Measured copy: {copy_bw:.0f} GB/s (1 GiB device to device, read + write). " if copy_bw else ""
    (out / "gpu_kernels.json").write_text(json.dumps(
        {"suite": "gpu kernels (W4A16, group 128)", **base, "rows": kernels,
         "note": copy_note + args.note}, indent=1) + "\n")
    (out / "gpu_checks.json").write_text(json.dumps(
        {"suite": "gpu checks", **base, "rows": checks, "note": args.checks_note}, indent=1) + "\n")
    print(f"{len(kernels)} kernel rows, {len(checks)} checks -> {out}/gpu_kernels.json, gpu_checks.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
