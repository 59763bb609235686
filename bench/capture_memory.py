"""Peak memory of `quantize_to_checkpoint`: whole-model load vs layer-by-layer (lazy) load.

Every row runs in a fresh subprocess and reports its peak resident set size (getrusage ru_maxrss), next to the
model's float size on disk and the floor a bare `import quantkit.quantize` already costs. Models: the embedded
SmolLM2-135M and a random llama about ten times larger, written once in float16 to a temporary folder.

    python bench/capture_memory.py                    # both models, rtn and gptq, old and new path
    python bench/capture_memory.py --models small --methods rtn
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from quantkit.shipped import shipped_dir

CALIB = shipped_dir("calibration") / "texts" / "prose_calib.txt"
# ~1.38B parameters, ~2.75 GB in float16: about 10x SmolLM2-135M, with the same vocabulary so its tokenizer fits
BIG = dict(hidden_size=2048, intermediate_size=4096, num_hidden_layers=28, num_attention_heads=16,
           num_key_value_heads=16, vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=False)
GB = 1e9


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def float_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def build_big(folder: Path, tokenizer_from: Path) -> Path:
    """The random llama, saved in float16; reused when the folder already holds it."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    if (folder / "config.json").is_file() and float_bytes(folder) > 0:
        return folder
    need = int(2.2 * 2 * 1.4e9)  # the fp16 model in RAM while saving, plus headroom
    if _mem_available() < need or shutil.disk_usage(folder.parent).free < 2 * need:
        sys.exit(f"not enough RAM or disk for the big model (needs ~{need / GB:.1f} GB of each)")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**BIG), dtype=torch.float16)
    with torch.no_grad():  # the default init (std 0.02) is fine for memory; keep weights non-degenerate anyway
        model.model.norm.weight.fill_(1.0)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, folder / name)
    return folder


def run_row(model: str, method: str, lazy: bool, out: str, samples: int, seq_len: int) -> dict:
    """Runs in the child: one quantisation job, then its peak RSS."""
    from quantkit.job import quantize_to_checkpoint
    from quantkit.recipe import Recipe

    floor = _peak_bytes()
    recipe = Recipe.model_validate({
        "model": model, "output": out, "overwrite": True, "quant": {"method": method, "scheme": "w4a16"},
        "calibration": {"spec": str(CALIB), "num_samples": samples, "seq_len": seq_len}})
    t = time.perf_counter()
    summary = quantize_to_checkpoint(recipe, lazy=lazy)
    return {"peak": _peak_bytes(), "import_peak": floor, "seconds": time.perf_counter() - t,
            "loading": summary["loading"]}


def _child(model: Path, method: str, lazy: bool, samples: int, seq_len: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="capmem-out-") as out:
        cmd = [sys.executable, __file__, "--row", str(model), method, "new" if lazy else "old", out,
               str(samples), str(seq_len)]
        p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if p.returncode:
            sys.exit(f"row failed: {' '.join(cmd)}\n{p.stderr[-3000:]}")
        return json.loads(p.stdout.strip().splitlines()[-1])


def _prepare(which: str, folder: str) -> Path:
    p = subprocess.run([sys.executable, __file__, "--prepare", which, folder], capture_output=True, text=True)
    if p.returncode:
        sys.exit(f"preparing the {which} model failed:\n{p.stderr[-3000:]}")
    return Path(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="small,big")
    ap.add_argument("--methods", default="rtn,gptq")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--big-dir", default=str(Path(tempfile.gettempdir()) / "quantkit-bench-big-llama"))
    ap.add_argument("--keep-big", action="store_true", help="leave the big model on disk for the next run")
    ap.add_argument("--row", nargs=6, help=argparse.SUPPRESS)
    ap.add_argument("--prepare", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.row:
        model, method, path, out, samples, seq_len = a.row
        print(json.dumps(run_row(model, method, path == "new", out, int(samples), int(seq_len))))
        return
    if a.prepare:
        from quantkit.models.embedded import embedded_model_dir

        small = embedded_model_dir()
        print(small if a.prepare[0] == "small" else build_big(Path(a.prepare[1]), small))
        return

    # Linux keeps a process's peak RSS across exec, so a child inherits this process's peak: the parent stays
    # small and leaves even model preparation to children.
    models = {}
    if "small" in a.models:
        models["SmolLM2-135M"] = _prepare("small", "")
    big_dir = Path(a.big_dir)
    if "big" in a.models:
        big_dir.mkdir(parents=True, exist_ok=True)
        models["random llama 1.4B"] = _prepare("big", str(big_dir))
    header = (f"{'model':<18} {'float GB':>8} {'method':<6} {'load':<14} {'peak RSS GB':>11} "
              f"{'minus import':>12} {'/ float':>7} {'seconds':>7}")
    print(header)
    print("-" * len(header))
    try:
        for label, folder in models.items():
            size = float_bytes(folder)
            for method in a.methods.split(","):
                for lazy in (False, True):
                    r = _child(folder, method, lazy, a.samples, a.seq_len)
                    net = r["peak"] - r["import_peak"]
                    print(f"{label:<18} {size / GB:>8.2f} {method:<6} {r['loading']:<14} {r['peak'] / GB:>11.2f} "
                          f"{net / GB:>12.2f} {net / size:>7.2f} {r['seconds']:>7.1f}", flush=True)
    finally:
        if "big" in a.models and not a.keep_big:
            shutil.rmtree(big_dir, ignore_errors=True)
    print(f"\ncalibration: {a.samples} x {a.seq_len} tokens of {CALIB.relative_to(CALIB.parents[2])}; scheme w4a16; "
          "'minus import' subtracts the peak RSS after importing quantkit, torch and transformers")


if __name__ == "__main__":
    main()
