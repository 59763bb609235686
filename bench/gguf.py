"""Suite `gguf`: quantkit's GGUF files against llama.cpp's own quantiser, on the same model, types and text (issue 40).

    python -m bench gguf [--quick]

For Q4_K_M, Q4_0 and Q3_K_M: llama.cpp's `llama-quantize` from our unquantised f16 export, without and with an
importance matrix (`llama-imatrix` on the calibration text below), against quantkit's rtn (the block encoder's
scale search, no data), gptq, and the default (`--method auto`: the same search with each input column's mean
squared activation weighing its rounding error), both on the calibration tokens llama-imatrix reads. Every
file is scored by llama.cpp itself (`llama-perplexity`, 256-token chunks) on held-out prose of the calibration's
domain and on code, a domain no row calibrated on; bits per weight are the file's bits over its weights. Each
file's perplexity relative to llama.cpp's imatrix quant of the same type comes with a 95% paired bootstrap
interval over the chunks (per-chunk NLL recovered from llama-perplexity's running values).
The model is the embedded SmolLM2-135M (itself a Q4_1 GGUF dequantised, so every row starts from the same float
model); suite `gguf_qwen2` (bench/gguf_qwen2.py) makes the same table for a Qwen2 model.
"""
from __future__ import annotations

import math
import re
import subprocess
from pathlib import Path

from .score import paired_ratio

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CALIB = ROOT / "calibration" / "texts" / "prose_calib.txt"
TEXTS = {"ppl prose (held out)": HERE / "data" / "eval_prose.txt", "ppl code (other domain)":
         ROOT / "calibration" / "texts" / "code_calib.txt"}
CTX = 256
CALIB_SAMPLES = 8  # x CTX tokens, for both llama-imatrix (--chunks) and quantkit's gptq
LLAMA_TYPES = {"q4_k_m": "Q4_K_M", "q4_0": "Q4_0", "q3_k_m": "Q3_K_M"}
VARIANTS = ("llama-quantize", "llama-quantize + imatrix", "quantkit rtn", "quantkit gptq", "quantkit default")
ROWS = [{"name": "float16"}] + [{"name": f"{s} {v}", "scheme": s, "variant": v} for s in LLAMA_TYPES
                                for v in VARIANTS]


def _run(cmd: list[str], timeout: int = 1800) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{Path(cmd[0]).name} failed: {(proc.stderr or proc.stdout)[-800:]}")
    return proc.stdout + proc.stderr


def _perplexity(bin_dir: Path, gguf: Path, text: Path) -> tuple[float, list[float]]:
    """(llama-perplexity's estimate, each chunk's mean negative log-likelihood)."""
    out = _run([str(bin_dir / "llama-perplexity"), "-m", str(gguf), "-f", str(text), "-c", str(CTX), "-b", str(CTX),
                "-t", "2"])
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", out)
    if not m:
        raise RuntimeError(f"llama-perplexity printed no estimate for {gguf.name}")
    return float(m.group(1)), chunk_nll([float(v) for v in re.findall(r"\[\d+\]([0-9.]+)", out)])


def chunk_nll(running: list[float]) -> list[float]:
    """Each chunk's mean NLL from llama-perplexity's running perplexities ([k] is over chunks 1..k, every chunk
    scoring the same number of tokens): k ln p_k - (k - 1) ln p_(k-1)."""
    logs = [math.log(p) for p in running]
    return [(k + 1) * logs[k] - k * (logs[k - 1] if k else 0.0) for k in range(len(logs))]


def _versus(ratio: tuple[float, float, float]) -> str:
    r, lo, hi = ((x - 1) * 100 for x in ratio)
    return f"{r:+.1f}% [{lo:+.1f}, {hi:+.1f}]"


def _weights(gguf: Path) -> int:
    from gguf import GGUFReader

    return sum(int(t.n_elements) for t in GGUFReader(str(gguf)).tensors)


def _make(row: dict, work: Path, bin_dir: Path, f16: Path, imatrix: Path, model: str | None) -> Path:
    from quantkit.gguf_job import quantize_to_gguf

    scheme, variant = row["scheme"], row["variant"]
    out = work / f"{scheme}-{variant.replace(' ', '-').replace('(', '').replace(')', '').replace('+', '')}.gguf"
    if variant.startswith("llama-quantize"):
        extra = ["--imatrix", str(imatrix)] if "imatrix" in variant else []
        _run([str(bin_dir / "llama-quantize"), *extra, str(f16), str(out), LLAMA_TYPES[scheme], "2"])
    elif variant.endswith(("gptq", "default")):  # the default calibrates on the text llama-imatrix reads
        quantize_to_gguf(model, str(out), scheme, method="gptq" if variant.endswith("gptq") else None,
                         overwrite=True, calib=str(CALIB), num_samples=CALIB_SAMPLES, seq_len=CTX)
    else:
        quantize_to_gguf(model, str(out), scheme, method="rtn", overwrite=True)
    return out


def run(rows: list[dict], quick: bool) -> dict:
    return run_model(rows, quick, None, "SmolLM2-135M (embedded)", HERE / "out" / "gguf")


def run_model(rows: list[dict], quick: bool, model: str | None, model_label: str, work: Path) -> dict:
    """The table for MODEL (a float Hugging Face folder; None: the embedded SmolLM2), files made under WORK."""
    from quantkit.gguf_job import quantize_to_gguf

    bin_dir = Path(_run(["bash", str(HERE / "llama_cpp_build.sh")], timeout=7200).strip().splitlines()[-1])
    work.mkdir(parents=True, exist_ok=True)
    f16 = work / "f16.gguf"
    quantize_to_gguf(model, str(f16), "f16", overwrite=True)
    imatrix = work / "imatrix.gguf"
    _run([str(bin_dir / "llama-imatrix"), "-m", str(f16), "-f", str(CALIB), "-o", str(imatrix), "-c", str(CTX),
          "--chunks", str(CALIB_SAMPLES), "-t", "2"])
    n = _weights(f16)
    texts = dict(list(TEXTS.items())[:1]) if quick else TEXTS
    out, chunks = [], {}
    for row in rows:
        path = f16 if row["name"] == "float16" else _make(row, work, bin_dir, f16, imatrix, model)
        size = path.stat().st_size
        scored = {label: _perplexity(bin_dir, path, text) for label, text in texts.items()}
        chunks[row["name"]] = {label: c for label, (_, c) in scored.items()}
        out.append({"name": row["name"], "file MB": round(size / 1e6, 2), "bits/weight": round(8 * size / n, 3),
                    **{label: round(p, 4) for label, (p, _) in scored.items()}})
    for r in out:  # each file against llama.cpp's imatrix quant of its type, chunk by chunk on the same text
        ref = chunks.get(f"{r['name'].split()[0]} llama-quantize + imatrix")
        if ref is None or r["name"].endswith("+ imatrix"):
            continue
        for label in texts:
            r[f"vs llama imatrix, {label.split()[1]} (95%)"] = _versus(paired_ratio(chunks[r["name"]][label],
                                                                                   ref[label]))
    return {"setup": {"model": model_label, "calibration": f"{CALIB.relative_to(ROOT)}, "
                      f"{CALIB_SAMPLES} x {CTX} tokens (imatrix chunks and gptq samples)",
                      "scoring": f"llama-perplexity -c {CTX}, llama.cpp {bin_dir.parent.parent.name}",
                      "texts": ", ".join(str(p.relative_to(ROOT)) for p in texts.values())},
            "rows": out}
