"""Serving throughput of `quantkit serve` against vLLM's CPU build on one checkpoint: tokens/s at 1 and 16 concurrent.

Usage: python bench/serve_vs_vllm.py [--checkpoint DIR] [--concurrency 1 16] [--requests 16] [--max-tokens 64]
       [--prompt-tokens 128] [--threads 2] [--only quantkit|vllm] [--vllm-python .venv-vllm/bin/python]
       [--vllm-bind cores|auto] [--repeat N] [--quantkit-src OTHER_CHECKOUT] [--json FILE]

Without --checkpoint it writes the demo's W4 g64 SmolLM2-135M (`quantkit demo`, float16: what vLLM needs) under
bench/out/serve-vs-vllm. Each server is started alone (never both at once: on a small machine they would fight
for the same cores), waited for at /health, warmed with one request, then given the same requests at each
concurrency: the same token-id prompts (windows of bench/data/eval_prose.txt), greedy, `ignore_eos`, a fixed
max_tokens, so both generate exactly the same number of tokens (the table prints each server's totals).
tokens/s = completion tokens summed over the requests / wall seconds from the first send to the last answer.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out" / "serve-vs-vllm"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def prompts(checkpoint: Path, n: int, length: int) -> list[list[int]]:
    """n windows of `length` tokens from the held-out prose, tokenised once here so both servers get the same ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(checkpoint))
    ids = tok((ROOT / "bench" / "data" / "eval_prose.txt").read_text())["input_ids"]
    stride = max(length, (len(ids) - length) // max(1, n))
    out = [ids[i * stride: i * stride + length] for i in range(n)]
    if any(len(p) < length for p in out):
        raise SystemExit(f"eval_prose.txt has {len(ids)} tokens: too few for {n} prompts of {length}")
    return out


def server_command(kind: str, checkpoint: Path, port: int, a) -> tuple[list, dict]:
    threads = a.threads
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if kind == "quantkit":
        # --quantkit-src: another checkout's package first on the path (the editable install would win over
        # PYTHONPATH), to measure a change against the code before it
        boot = "import sys; sys.path.insert(0, sys.argv.pop(1)); from quantkit.cli import main; sys.exit(main())"
        src = str(a.quantkit_src.resolve()) if a.quantkit_src else str(ROOT)
        return [sys.executable, "-c", boot, src, "serve", str(checkpoint), "--port", str(port), "--threads",
                str(threads), "--model-name", "m"], env
    # vLLM's CPU worker binds one OpenMP thread per listed core (vllm/envs.py: VLLM_CPU_OMP_THREADS_BIND).
    # "cores": the same `threads` cores quantkit computes on, none reserved; "auto": vLLM's own default, which
    # keeps one core back for its frontend and engine loop (on 2 cores: 1 compute thread)
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    if a.vllm_bind == "cores":
        env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    return [a.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint),
            "--served-model-name", "m", "--dtype", "float16", "--port", str(port), "--max-model-len", "1024",
            "--enforce-eager", "--max-num-seqs", "64"], env


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 900) -> float:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return time.time() - t0
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"no /health answer within {timeout} s")


async def one(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = await client.post(url + "/v1/completions", json=body, timeout=3600)
    r.raise_for_status()
    return r.json()


async def run_load(url: str, batch: list[list[int]], concurrency: int, max_tokens: int) -> dict:
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        async def gated(p):
            async with gate:
                return await one(client, url, p, max_tokens)

        t0 = time.perf_counter()
        answers = await asyncio.gather(*(gated(p) for p in batch))
        seconds = time.perf_counter() - t0
    tokens = sum(a["usage"]["completion_tokens"] for a in answers)
    return {"seconds": seconds, "completion_tokens": tokens, "tok_s": tokens / seconds,
            "texts": [a["choices"][0]["text"] for a in answers]}


def bench_server(kind: str, a, checkpoint: Path, batch: list[list[int]]) -> dict:
    port = free_port()
    cmd, env = server_command(kind, checkpoint, port, a)
    log = open(OUT / f"{kind}.log", "w")
    # a session of its own: the whole process group (vLLM's engine core is a child process) is stopped below
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    result = {"load_before": load_average()}
    try:
        result["startup_s"] = wait_healthy(url, proc)
        asyncio.run(run_load(url, batch[:1], 1, a.max_tokens))  # warm-up: first-call allocations, lazy imports
        for c in a.concurrency:
            result[c] = asyncio.run(run_load(url, batch, c, a.max_tokens))
            print(f"{kind} c={c}: {result[c]['completion_tokens']} tokens in {result[c]['seconds']:.1f} s = "
                  f"{result[c]['tok_s']:.1f} tok/s (load {result['load_before']})", flush=True)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.close()
    return result


def table(results: dict, concurrency: list[int]) -> str:
    lines = ["| concurrent requests | vLLM tok/s | quantkit tok/s | quantkit / vLLM "
             "| completion tokens (vLLM / quantkit) |", "|---:|---:|---:|---:|---|"]
    for c in concurrency:
        v, q = results.get("vllm", {}).get(c), results.get("quantkit", {}).get(c)
        vs = f"{v['tok_s']:.1f}" if v else "-"
        qs = f"{q['tok_s']:.1f}" if q else "-"
        ratio = f"{q['tok_s'] / v['tok_s']:.2f}" if v and q else "-"
        counts = f"{v['completion_tokens'] if v else '-'} / {q['completion_tokens'] if q else '-'}"
        lines.append(f"| {c} | {vs} | {qs} | {ratio} | {counts} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--requests", type=int, default=16, help="requests per concurrency level")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1, help="runs per server, alternated; the best is reported")
    ap.add_argument("--only", choices=["quantkit", "vllm"])
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--vllm-bind", choices=["cores", "auto"], default="cores",
                    help="vLLM's thread binding: the same cores as quantkit, or vLLM's default (one core reserved)")
    ap.add_argument("--quantkit-src", type=Path, help="serve the quantkit package of this checkout instead")
    ap.add_argument("--json", type=Path, help="also write the results here")
    a = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    checkpoint = a.checkpoint or OUT / "smollm2-w4"
    if not (checkpoint / "config.json").exists():
        subprocess.run([str(Path(sys.executable).parent / "quantkit"), "demo", "-o", str(checkpoint), "-q"],
                       check=True)
    batch = prompts(checkpoint, a.requests, a.prompt_tokens)
    runs: dict[str, list[dict]] = {}
    for _ in range(a.repeat):  # alternated, so a burst of outside load falls on both servers alike
        for kind in ("vllm", "quantkit"):
            if a.only in (None, kind):
                runs.setdefault(kind, []).append(bench_server(kind, a, checkpoint, batch))
    # the best of the repeats: on a shared machine the slower runs measure the other jobs
    results = {k: {c: max((r[c] for r in rs), key=lambda x: x["tok_s"]) for c in a.concurrency}
               | {"load_before": "; ".join(r["load_before"] for r in rs)} for k, rs in runs.items()}
    print(f"\n{a.requests} requests of {a.prompt_tokens} prompt tokens, max_tokens {a.max_tokens}, greedy, "
          f"ignore_eos, {a.threads} threads, best of {a.repeat}; load average before each server start: "
          + ", ".join(f"{k} {r['load_before']}" for k, r in results.items()))
    print(table(results, a.concurrency))
    if len(results) == 2:
        for c in a.concurrency:
            same = sum(x == y for x, y in zip(results["vllm"][c]["texts"], results["quantkit"][c]["texts"]))
            print(f"c={c}: {same}/{a.requests} completions identical in text (W4 kernels differ; not required)")
    if a.json:
        a.json.write_text(json.dumps({k: [{str(c): v for c, v in r.items()} for r in rs] for k, rs in runs.items()},
                                     indent=2))


if __name__ == "__main__":
    main()
