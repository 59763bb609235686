"""Suite `serve_split` (issue 41, requirement 3): what `quantkit serve` adds to one request beyond the model's
own work. One request at a time, the same prompt and length: the end-to-end time an HTTP client measures
against what prefill + decode predict, measured with the runtime alone in this process (open_model + generate,
the objects serve runs, no server). The split of each served request comes from the server itself
(GET /v1/details/{id}: tokenise, queue, prefill, decode); HTTP is what the client measured beyond those.
Goal: served tokens/s >= 85% of the prediction. Each row runs in a process of its own (`python -m
bench.serve_split ROW_JSON`), under the row's environment: the ISA-capped rows take torch's and oneDNN's
AVX2 paths, as on a CPU without AVX-512, and the server they start inherits the cap.

    python -m bench serve_split [--quick]
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from .serve_vs_vllm import free_port, load_average, prompts, wait_healthy

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out" / "serve-split"
GOAL = 0.85
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
ROWS = [{"name": "w4 g64 rtn, 128 prompt + 64 new tokens", "prompt": 128, "new": 64, "repeat": 5},
        {"name": "w4 g64 rtn, 512 prompt + 32 new tokens", "prompt": 512, "new": 32, "repeat": 3},
        {"name": "w4 g64 rtn, 128 prompt + 64 new tokens, ISA capped to AVX2", "prompt": 128, "new": 64,
         "repeat": 5, "env": AVX2}]


def checkpoint() -> Path:
    """SmolLM2-135M W4 g64 (RTN: the method does not change the decode cost), written once."""
    ckpt = OUT / "w4g64"
    if not (ckpt / "quantkit.json").is_file():
        from quantkit.models.embedded import embedded_model_dir

        OUT.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "quantkit", "quantize", str(embedded_model_dir()), "-o", str(ckpt),
                        "--method", "rtn", "--group-size", "64", "--overwrite", "-q"], check=True)
    return ckpt


def served(ckpt: Path, prompt: list[int], new: int, repeat: int) -> list[dict]:
    """Each request's client-side seconds and the server's own split, after one warm-up request."""
    port = free_port()
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "serve.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "quantkit", "serve", str(ckpt), "--port", str(port),
                                 "--model-name", "m"], stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, proc)
            body = {"model": "m", "prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True}
            out = []
            with httpx.Client(timeout=600) as client:
                for i in range(repeat + 1):
                    t0 = time.perf_counter()
                    r = client.post(url + "/v1/completions", json=body)
                    seconds = time.perf_counter() - t0
                    r.raise_for_status()
                    metrics = client.get(f"{url}/v1/details/{r.headers['x-request-id']}").json()["metrics"]
                    if i:  # the first is the warm-up: lazy imports, first-call allocations
                        out.append({"seconds": seconds, **metrics["split_s"]})
            return out
        finally:
            proc.terminate()
            proc.wait(timeout=60)


def alone(ckpt: Path, prompt: list[int], new: int, repeat: int) -> list[float]:
    """Prefill + decode seconds of the same request on the runtime alone: time to first token plus the decode
    of the rest, from the sequence's own metrics (as the server reports them)."""
    from quantkit.open_model import open_model
    from quantkit.runtime.generate import generate
    from quantkit.runtime.sampling import SamplingParams

    opened = open_model(str(ckpt))
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True).validate()
    out = []
    for i in range(repeat + 1):
        drafter = opened.make_drafter() if opened.make_drafter else None  # what serve's engine would use
        seq = generate(opened.model, prompt, params, tokenizer=opened.tokenizer, drafter=drafter)
        m = seq.metrics
        if i:
            out.append(m.t_last - m.t_start)
    return out


def measure(row: dict, repeat: int) -> dict:
    """One row, in this process: the served requests, then the same request on the runtime alone."""
    ckpt = checkpoint()
    prompt = prompts(ckpt, 1, row["prompt"])[0]
    load = load_average()
    runs = served(ckpt, prompt, row["new"], repeat)
    predicted = statistics.median(alone(ckpt, prompt, row["new"], repeat))
    e2e = statistics.median(r["seconds"] for r in runs)
    split = {k: round(statistics.median(r[k] for r in runs), 4) for k in ("tokenise", "queue", "prefill", "decode")}
    split["http"] = round(e2e - sum(split.values()), 4)
    return {"name": row["name"], "env": " ".join(f"{k}={v}" for k, v in row.get("env", {}).items()) or "-",
            "served_s": round(e2e, 4), "predicted_s": round(predicted, 4),
            "served_vs_predicted": round(predicted / e2e, 3), "goal": GOAL, "meets_goal": predicted / e2e >= GOAL,
            "split_s": split, "repeats": repeat, "load_average_before": load}


def run(rows: list[dict], quick: bool) -> dict:
    ckpt = checkpoint()  # written once, before any row's process
    results = []
    for row in rows:
        repeat = 2 if quick else row["repeat"]
        p = subprocess.run([sys.executable, "-m", "bench.serve_split", json.dumps({**row, "repeat": repeat})],
                           cwd=ROOT, env={**os.environ, **row.get("env", {})}, capture_output=True, text=True)
        if p.returncode:
            raise RuntimeError(f"{row['name']}: exit {p.returncode}\n{p.stderr[-3000:]}")
        r = json.loads(p.stdout.strip().splitlines()[-1])
        results.append(r)
        print(f"{r['name']}: served {r['served_s']:.3f} s, predicted {r['predicted_s']:.3f} s "
              f"({r['served_vs_predicted']:.0%} of served speed; goal {GOAL:.0%}); split {r['split_s']}", flush=True)
    return {"setup": {"checkpoint": str(ckpt.relative_to(ROOT)), "model": "SmolLM2-135M W4 g64 (RTN)",
                      "requests": "one at a time, greedy, ignore_eos, token-id prompts from bench/data/eval_prose.txt",
                      "rows": "each in its own process, under the row's env"},
            "rows": results}


if __name__ == "__main__":
    row = json.loads(sys.argv[1])
    print(json.dumps(measure(row, row["repeat"])))
