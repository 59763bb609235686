"""Score one checkpoint with vLLM's offline engine; run by vLLM's own Python, not quantkit's.

vLLM pins its own torch and transformers, so it lives in a venv of its own and this file is run there as a
script (`VLLM_PYTHON vllm_worker.py JOB.json OUT.json`): it imports nothing from quantkit, only the standard
library and vllm. The job names the checkpoint, the dtype it is served in, token windows to score (every
token's log-probability given the ones before it: perplexity) and prompts to continue greedily.

The job file holds {"jobs": [job, ...]}, run one after another in this process (the engine is started once
per job; the interpreter and vLLM's imports, a good part of a start, are paid once). Output: {"results":
[result, ...]}, each {"ok": true, "nll": [[-logprob per scored token] per window], "greedy": [[ids] per
prompt], "seconds": {...}} or {"ok": false, "error": "the engine's own message"} when vLLM refuses the
checkpoint (e.g. a scheme its CPU build has no kernel for), so the caller can report it instead of crashing.
Each loaded job also reports "kernels": which linear kernel vLLM itself chose for each quantised Linear, and
how many Linears run it, read off the loaded model (its choice depends on the CPU, so it is asked, not guessed).

QUANTKIT_VLLM_NO_AMX=1 makes vLLM see a CPU without AMX tiles, as on AMD EPYC: it then takes the kernel paths
such a CPU takes (oneDNN for INT8 activations instead of the AMX SGL kernels). The caller also caps oneDNN's
instruction set (ONEDNN_MAX_CPU_ISA), so the GEMMs themselves run the non-AMX code.
"""
from __future__ import annotations

import json
import os
import sys
import time


def _engine(job: dict):
    from vllm import LLM

    longest = max([len(w) for w in job.get("windows", [])] + [len(p) + job.get("max_new", 0)
                                                              for p in job.get("prompts", [])] + [16])
    kwargs = dict(model=job["model"], dtype=job["dtype"], max_model_len=longest + 8, enforce_eager=True, seed=0,
                  max_num_seqs=job.get("max_num_seqs", 16))
    if job.get("kv_cache_dtype"):
        kwargs["kv_cache_dtype"] = job["kv_cache_dtype"]
    return LLM(**kwargs)


def _kernels(model) -> dict:
    """{"<quant method>/<scheme>/<kernel>[/<kernel path>]": number of Linears}: what vLLM selected."""
    found: dict = {}
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        scheme = getattr(module, "scheme", None)
        if method is None or scheme is None:
            continue
        kernel = getattr(scheme, "kernel", None)
        if kernel is None:  # some schemes keep their kernel under another attribute name
            kernel = next((v for v in vars(scheme).values() if type(v).__name__.endswith("Kernel")), None)
        name = "/".join([type(method).__name__, type(scheme).__name__, type(kernel).__name__ if kernel else "-"])
        path = getattr(kernel, "linear_method", None)  # CPU INT8: the AMX SGL kernel or oneDNN
        if path is not None:
            name += "/" + path.__name__.removeprefix("_apply_weights_")
        found[name] = found.get(name, 0) + 1
    return found


def _nll(llm, windows: list[list[int]]) -> list[list[float]]:
    """-log p(token | earlier tokens) for every token after the first of each window."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=w) for w in windows], sp, use_tqdm=False)
    result = []
    for w, out in zip(windows, outs):
        lps = out.prompt_logprobs  # position 0 has no context: None
        result.append([-float(lps[i][w[i]].logprob) for i in range(1, len(w))])
    return result


def _greedy(llm, prompts: list[list[int]], n: int) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


class _Late(BaseException):
    """A job's own time limit ran out (job["timeout_s"]); not an Exception, so the engine start's handler
    cannot take it for a refusal."""


def _late(signum, frame):
    raise _Late()


def run(job: dict) -> dict:
    """One job; with job["timeout_s"], an answer within that many seconds or ok=False saying so (a scheme with
    no fast CPU kernel can run on a reference GEMM for minutes). The alarm interrupts Python between vLLM's
    operations; a hang inside one is left to the caller's limit on the whole worker."""
    import signal

    limit = job.get("timeout_s")
    if limit:
        signal.signal(signal.SIGALRM, _late)
        signal.alarm(int(limit))
    try:
        return _run(job)
    except _Late:
        return {"ok": False, "error": f"no answer within {limit} s (the engine was still running)"}
    finally:
        if limit:
            signal.alarm(0)


def _run(job: dict) -> dict:
    import gc

    t0 = time.time()
    try:
        llm = _engine(job)
    except Exception as e:  # noqa: BLE001  (vLLM raises many types; each means "does not load here")
        return {"ok": False, "error": f"{type(e).__name__}: {' '.join(str(e).split())[:600]}"}
    try:
        kernels = llm.apply_model(_kernels)[0]
        t1 = time.time()
        nll = _nll(llm, job["windows"]) if job.get("windows") else []
        t2 = time.time()
        greedy = _greedy(llm, job["prompts"], job["max_new"]) if job.get("prompts") else []
    finally:
        # the engine core is a child process holding the KV cache: stop it before the next job's starts
        shutdown = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if shutdown is not None and hasattr(shutdown, "shutdown"):
            shutdown.shutdown()
        del llm
        gc.collect()
    return {"ok": True, "nll": nll, "greedy": greedy, "kernels": kernels,
            "seconds": {"load": round(t1 - t0, 2), "score": round(t2 - t1, 2), "greedy": round(time.time() - t2, 2)}}


if __name__ == "__main__":  # vLLM's engine starts worker processes that re-import this file
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # the engine in this process: its model can be read (kernels above), and no engine process is started
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if os.environ.get("QUANTKIT_VLLM_NO_AMX") == "1":
        import torch

        torch.cpu._is_amx_tile_supported = lambda: False
    job_path, out_path = sys.argv[1], sys.argv[2]
    with open(job_path) as f:
        jobs = json.load(f)["jobs"]
    results = []
    for job in jobs:
        results.append(run(job))
        with open(out_path, "w") as f:  # after every job: a crash later still leaves the finished ones
            json.dump({"results": results}, f)
