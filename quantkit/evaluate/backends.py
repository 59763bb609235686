"""One checkpoint scored by several engines on the same tokens: quantkit's runtime, transformers, vLLM, and
for a GGUF file llama.cpp (llama_cpp_backend.py).

Each backend returns, per token window, the negative log-likelihood of every token after the first, and per
prompt its greedy continuation. vLLM pins its own torch and transformers, so it runs in a venv of its own
(bench/vllm_env.sh makes one) through vllm_worker.py; the path of that venv's python comes from
--vllm-python or QUANTKIT_VLLM_PYTHON.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..dtypes import DTYPES
from ..errors import UserError

BACKENDS = ("quantkit", "transformers", "vllm", "llama.cpp")
WORKER = Path(__file__).with_name("vllm_worker.py")
# vLLM's CPU build quantises bfloat16 activations to int8 for 4-bit weights on AMX machines (W4A8) unless told
# not to; a W4A16 checkpoint is then scored as something else, so the comparison switches it off and says so.
VLLM_ENV = {"VLLM_CPU_INT4_W4A8": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
# A CPU without AMX (AMD EPYC, older Xeons), emulated on one with it: vLLM is told there are no AMX tiles, so
# it selects the kernels such a CPU gets, and oneDNN is capped to AVX-512 with VNNI and BF16, so they run the
# code such a CPU runs. The CPU kinds vLLM's x86 build tells apart are these two.
NO_AMX_ENV = {"QUANTKIT_VLLM_NO_AMX": "1", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}


@dataclass
class Scores:
    backend: str
    ok: bool
    nll: list[list[float]] = field(default_factory=list)
    greedy: list[list[int]] = field(default_factory=list)
    error: str | None = None
    margins: list[list[float]] = field(default_factory=list)  # per prompt and step: top-1 minus top-2 log-prob
    kernels: dict = field(default_factory=dict)  # vLLM: the linear kernel it chose -> number of Linears
    top1: list[list[int]] = field(default_factory=list)  # per window and position: the most likely next token

    @property
    def perplexity(self) -> float | None:
        n = sum(len(w) for w in self.nll)
        return math.exp(sum(sum(w) for w in self.nll) / n) if n else None


def vllm_python(explicit: str | None = None) -> str:
    path = explicit or os.environ.get("QUANTKIT_VLLM_PYTHON")
    if not path:
        raise UserError("the vllm backend runs in vLLM's own venv; make it with `bash bench/vllm_env.sh` and pass "
                        "--vllm-python .venv-vllm/bin/python (or set QUANTKIT_VLLM_PYTHON)")
    if not Path(path).is_file():
        raise UserError(f"--vllm-python '{path}' does not exist; make the venv with `bash bench/vllm_env.sh`")
    # absolute, not resolved: the worker runs in another folder, and a venv's python is a symlink that must
    # stay one for the venv to be used
    return str(Path(path).absolute())


@torch.inference_mode()
def score_transformers(path: str, windows, prompts, max_new: int, dtype: str) -> Scores:
    """transformers (+ compressed-tensors, which decompresses a quantised checkpoint on a CPU)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], **_transformers_kwargs(path)).eval()

    margins = []

    def greedy(p: list[int]) -> list[int]:
        out = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=max_new, min_new_tokens=max_new,
                             pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        top2 = [s[0].float().log_softmax(-1).topk(2).values for s in out.scores]
        margins.append([float(t[0] - t[1]) for t in top2])
        return out.sequences[0, len(p):].tolist()

    scores = _score_forward("transformers", lambda ids: model(ids).logits[0, :-1].float().log_softmax(-1),
                            windows, prompts, greedy)
    scores.margins = margins
    return scores


def _transformers_kwargs(path: str) -> dict:
    """transformers 5.24's compressed path registers zero points unpacked and re-initialises the packed ones it
    reads (a load error naming every weight_zero_point); its dequantize=True path runs compressed-tensors' own
    decompress, which reads them as written. Asymmetric checkpoints take that path, and so do weight-only FP4
    ones: the compressed path decompresses their weights to bfloat16 at every call, which a float16/float32 model
    refuses. FP4 with activations (nvfp4-a4) stays on the compressed path, the only one that quantises them
    (dequantize=True would score the weights alone): it runs in bfloat16."""
    from transformers import CompressedTensorsConfig

    qc = json.loads((Path(path) / "config.json").read_text()).get("quantization_config") or {}
    groups = (qc.get("config_groups") or {}).values()
    asym = any((g.get("weights") or {}).get("symmetric") is False for g in groups)
    fp4 = any((g.get("weights") or {}).get("type") == "float" and (g.get("weights") or {}).get("num_bits") == 4
              and not g.get("input_activations") for g in groups)
    return {"quantization_config": CompressedTensorsConfig(dequantize=True)} if asym or fp4 else {}


@torch.inference_mode()
def score_quantkit(path: str, windows, prompts, max_new: int, dtype: str) -> Scores:
    """quantkit's runtime, as `quantkit serve` runs the checkpoint."""
    from ..runtime.checkpoint import load
    from ..runtime.generate import generate
    from ..runtime.sampling import SamplingParams
    from .perplexity import window_logprobs

    model = load(path, dtype=DTYPES[dtype])
    params = SamplingParams(max_tokens=max_new, ignore_eos=True)
    return _score_forward("quantkit", lambda ids: window_logprobs(model, ids[0], "cpu"), windows, prompts,
                          lambda p: [t.id for t in generate(model, p, params).tokens])


def _score_forward(name, logprobs_of, windows, prompts, greedy_of) -> Scores:
    """logprobs_of(ids [1, T]) -> [T-1, V] log-probabilities of each next token."""
    nll, top1 = [], []
    for w in windows:
        ids = torch.tensor([w])
        logp = logprobs_of(ids)
        nll.append((-logp.gather(-1, ids[0, 1:, None])[:, 0]).tolist())
        top1.append(logp.argmax(-1).tolist())
    return Scores(name, True, nll, [greedy_of(p) for p in prompts], top1=top1)


def score_vllm(jobs: list[dict], python: str, timeout: int = 3600, no_amx: bool = False) -> list[Scores]:
    """Each job: {"model", "dtype", "windows", "prompts", "max_new", optional "kv_cache_dtype"}; all run in one
    worker process, one engine after another. A job the engine refuses or never answers gets ok=False and the
    root cause vLLM logged (its own exception names only "see root cause above"). NO_AMX: run vLLM as on a CPU
    without AMX (NO_AMX_ENV)."""
    env = {**os.environ, **VLLM_ENV, **(NO_AMX_ENV if no_amx else {})}
    with tempfile.TemporaryDirectory(prefix="quantkit-vllm-") as tmp:
        job_file, out_file, log_file = Path(tmp) / "jobs.json", Path(tmp) / "out.json", Path(tmp) / "worker.log"
        job_file.write_text(json.dumps({"jobs": jobs}))
        with open(log_file, "w") as log:
            # a session of its own: vLLM's engine and worker processes can outlive a failed start (one was
            # found spinning a core) and hold the output open, so the whole group is killed at the end
            proc = subprocess.Popen([python, str(WORKER), str(job_file), str(out_file)], stdout=log,
                                    stderr=subprocess.STDOUT, env=env, cwd=tmp,
                                    start_new_session=True)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
            finally:
                _kill_group(proc.pid)
        results = json.loads(out_file.read_text())["results"] if out_file.is_file() else []
        cause = root_cause(log_file.read_text(errors="replace"))
    if len(results) < len(jobs):
        results += [{"ok": False, "error": f"no answer within {timeout} s (the engine hung or died)"
                                           + (f": {cause}" if cause else "")}] * (len(jobs) - len(results))
    out = []
    for r in results:
        err = r.get("error")
        if err and cause and "root cause" in err:
            err = cause
        out.append(Scores("vllm", r["ok"], r.get("nll", []), r.get("greedy", []), err,
                          kernels=r.get("kernels", {})))
    return out


def _kill_group(pid: int) -> None:
    import signal

    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


_WRAPPERS = ("initialization failed", "See root cause", "see stack trace")


def root_cause(log: str) -> str | None:
    """The last exception line vLLM logged that is not one of its wrappers, with the reason lines under it."""
    import re

    lines = [re.sub(r"^\(\w[\w ]*pid=\d+\) \w+ [\d-]+ [\d:]+ \[[^\]]+\] ?", "", ln) for ln in log.splitlines()]
    found = None
    for i, ln in enumerate(lines):
        if re.match(r"^[A-Za-z_.]*(Error|Exception): ", ln) and not any(w in ln for w in _WRAPPERS):
            reasons = []
            for nxt in lines[i + 1:i + 6]:
                if not nxt.startswith(" ") or not nxt.strip():
                    break
                reasons.append(nxt.strip())
            found = " ".join([ln.strip(), *reasons])
    return found[:600] if found else None


def greedy_agreement(ref: Scores, other: Scores) -> list[int]:
    """Per prompt, how many greedy tokens the two continuations share before they first part."""
    return [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            for a, b in zip(ref.greedy, other.greedy)]


# Two engines' roundings may flip a greedy choice whose top two tokens are this close (nats); a wrong scale or
# zero point moves logits by far more, so a parting at such a near-tie is not a failure.
NEAR_TIE = 0.05


def compare(ref: Scores, other: Scores, n_greedy: int = 16) -> dict:
    """Perplexity ratio, mean and largest |Δ log p| per token, and the greedy tokens both agree on: greedy is
    ok when each continuation agrees for n_greedy tokens or parts where REF's top two were a near-tie."""
    if not (ref.ok and other.ok):
        return {"ok": False, "error": other.error or ref.error}
    signed = [b - a for wa, wb in zip(ref.nll, other.nll) for a, b in zip(wa, wb)]
    deltas = [abs(d) for d in signed]
    mean = sum(signed) / len(signed)
    sd = math.sqrt(sum((d - mean) ** 2 for d in signed) / max(len(signed) - 1, 1))
    agree = greedy_agreement(ref, other)
    return {"ok": True, "ppl": other.perplexity, "ref_ppl": ref.perplexity,
            "ppl_rel": other.perplexity / ref.perplexity - 1, "logprob_mean_abs": sum(deltas) / len(deltas),
            # the standard error of the mean per-token difference: how far apart two engines' log perplexities
            # land by rounding noise alone, when that noise is unbiased
            "nll_diff_se": sd / math.sqrt(len(signed)),
            "logprob_max_abs": max(deltas), "greedy_agree": agree,
            "parting_margin": [m[a] if a < min(n_greedy, len(m)) else None
                               for a, m in zip(agree, ref.margins or [[]] * len(agree))],
            "greedy_ok": all(a >= min(n_greedy, len(g)) or (ref.margins and ref.margins[i][a] < NEAR_TIE)
                             for i, (a, g) in enumerate(zip(agree, ref.greedy)))}
