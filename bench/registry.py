"""The suites `python -m bench` runs, and what every suite's JSON carries (machine, date, command).

A suite is a module under bench/ with
    ROWS: list of {"name": str, ...}     the rows as data ("set": recipe overrides, or "args": a script's options)
    run(rows, quick: bool) -> dict       {"setup": {...}, "rows": [{"name": ..., figure: value, ...}, ...]}
Registering one is one line in SUITES below: "NAME": "bench.MODULE".
"""
from __future__ import annotations

import datetime
import importlib
import json
import platform
import shlex
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"

SUITES = {
    "quality": "bench.quality",
    "peers": "bench.peers",
    "decode": "bench.decode_suite",
    "serving": "bench.serving",
    "kernels": "bench.kernels_suite",
    "interop": "bench.interop",
    "scaling": "bench.scaling_suite",
    "serve_split": "bench.serve_split",
    "gguf": "bench.gguf",
    "gguf_qwen2": "bench.gguf_qwen2",
    "capped_default": "bench.capped_default",
    "gptq_time": "bench.gptq_time",
    "calib_size": "bench.calib_size",
}

# the instruction-set flags that choose CPU kernels (AVX-512 and AMX paths in torch, oneDNN and FBGEMM)
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
             "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16")


def suite(name: str):
    if name not in SUITES:
        from quantkit.errors import UserError

        raise UserError(f"no bench suite '{name}'; choose one of {', '.join(sorted(SUITES))} (or 'report')")
    return importlib.import_module(SUITES[name])


def select(rows: list[dict], only: str | None) -> list[dict]:
    picked = [r for r in rows if not only or only.lower() in r["name"].lower()]
    if not picked:
        from quantkit.errors import UserError

        raise UserError(f"--only '{only}' matches no row; rows: {', '.join(r['name'] for r in rows)}")
    return picked


def machine() -> dict:
    """lscpu's model name, the kernel-choosing ISA flags this CPU has, cores, torch and the GPU if any."""
    import torch

    model, flags = platform.processor() or "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": model, "isa": [f for f in ISA_FLAGS if f in flags], "cores": _cores(), "torch": torch.__version__,
            "gpu": gpu}


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def write(name: str, result: dict, argv: list[str], out_dir: Path = RESULTS) -> Path:
    """bench/results/NAME.json: machine, date, the command that made it, the suite's set-up and rows."""
    doc = {"suite": name, "command": "python -m bench " + shlex.join(argv), "machine": machine(),
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "load_average": _load_average(), **result}
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def _load_average() -> str | None:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return None
