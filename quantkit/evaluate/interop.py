"""The vLLM acceptance matrix: every checkpoint option quantkit writes, scored by vLLM and by transformers.

A checkpoint is right when the engines people serve with load it and score it as transformers does, in the
dtype it will be served in. For each case this writes a checkpoint of the embedded SmolLM2-135M (scales in
the serving dtype), scores the same token windows and greedy prompts in both engines and compares. Schemes
vLLM's CPU build has no kernel for are still offered to it, and what it answers is recorded as GPU-only.
Used by tests/test_vllm_interop.py (the gate) and bench/vllm_interop.py (the table in docs/vllm.md).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .backends import Scores, compare, score_quantkit, score_transformers, score_vllm

CALIB = {"calibration.spec": "{texts}/prose_calib.txt", "calibration.num_samples": 16, "calibration.seq_len": 128}
# AWQ's format is what is checked here, not its search: a coarse grid on few tokens keeps CI short
AWQ_FAST = {"quant.awq.grid": 5, "quant.awq.search_tokens": 512}
GPU_ONLY_TIMEOUT = 90  # seconds: a refusal comes within ~30; the FP8 path on this CPU build loads, then hangs
MIXED = [{"match": "re:.*mlp\\.down_proj", "scheme": "w4a16", "group_size": 32}]


@dataclass(frozen=True)
class Case:
    name: str
    overrides: dict
    dtype: str = "float16"  # written and served in
    cpu: bool = True  # vLLM's CPU build has a kernel for it
    kv_cache_dtype: str | None = None
    targets: list = field(default_factory=list)
    # the engine vLLM is compared with: transformers, or quantkit's runtime where transformers' compressed-tensors
    # forward rounds activations by another rule (W8A8: absmax/127.5 per token against vLLM's and quantkit's /127,
    # 1-2% perplexity apart on SmolLM2, whose int8 activations amplify any rounding change)
    reference: str = "transformers"
    # in the test suite's gate; False: a layout a gated case already loads (the same packed tensors and config,
    # another solver or dtype), scored for the full table by bench/vllm_interop.py only, to keep CI short
    gate: bool = True


CASES = [
    Case("w4 g64 sym rtn", {"quant.group_size": 64}, gate=False),  # the fp8 kv case scores this checkpoint too
    Case("w4 g32 asym rtn", {"quant.group_size": 32, "quant.symmetric": False}),
    Case("w4 channel sym rtn", {"quant.group_size": -1}),
    Case("w4 g64 gptq act-order weight", {"quant.group_size": 64, "quant.method": "gptq",
                                          "quant.gptq.actorder": "weight", **CALIB}),
    Case("w4 g64 awq", {"quant.group_size": 64, "quant.method": "awq", **AWQ_FAST, **CALIB}),
    Case("w4 g64 awq+gptq", {"quant.group_size": 64, "quant.method": "awq+gptq", "quant.gptq.actorder": "weight",
                             **AWQ_FAST, **CALIB}, gate=False),
    Case("w4 mixed g64 + down_proj g32", {"quant.group_size": 64}, targets=MIXED),
    Case("w4 g64 + fp8 kv cache", {"quant.group_size": 64, "quant.kv_cache": "fp8", **CALIB},
         kv_cache_dtype="fp8"),
    Case("w4 g64 sym rtn", {"quant.group_size": 64}, dtype="bfloat16"),
    Case("w4 g64 gptq act-order weight", {"quant.group_size": 64, "quant.method": "gptq",
                                          "quant.gptq.actorder": "weight", **CALIB}, dtype="bfloat16", gate=False),
    # W8A8 INT8 runs on vLLM's CPU INT8 kernels, served in bfloat16: on an AMX CPU its int8 GEMM aborts the engine
    # for float16 activations ("scale_C: scalar path not implemented", sgl-kernels/gemm_int8.cpp). SmoothQuant with
    # a fixed alpha: the format is checked here, not the search, which would cost minutes
    Case("w8a8 rtn", {"quant.scheme": "w8a8"}, dtype="bfloat16", reference="quantkit"),
    Case("w8a8 smooth 0.5 rtn", {"quant.scheme": "w8a8", "quant.smooth": True, "quant.smooth_alpha": 0.5, **CALIB},
         dtype="bfloat16", reference="quantkit"),
    # static per-tensor input scales: vLLM 0.32's CPU build loads it but scores 2.8% below both quantkit and
    # transformers (43.36 against 44.60 / 44.78), near its dynamic per-token score of the same weights (43.76):
    # its x86 SGL int8 kernel quantises activations per token and never reads input_scale (docs/vllm.md), so
    # this row is documented, not gated
    Case("w8a8-static smooth 0.5 rtn", {"quant.scheme": "w8a8-static", "quant.smooth": True, "quant.smooth_alpha": 0.5,
                                        **CALIB}, dtype="bfloat16", reference="quantkit", gate=False),
    Case("w8 channel rtn", {"quant.scheme": "w8a16", "quant.group_size": -1}, cpu=False),
    Case("fp8 dynamic", {"quant.scheme": "fp8-dynamic"}, cpu=False),
]
GATED = [c for c in CASES if c.gate]  # the cases tests/test_vllm_interop.py runs


def eval_tokens(text: Path, n_windows: int = 4, length: int = 128, n_prompts: int = 2):
    """Windows to score and prompts to continue, from TEXT (held out from every calibration set used here)."""
    from transformers import AutoTokenizer

    from ..models.embedded import embedded_model_dir

    ids = AutoTokenizer.from_pretrained(embedded_model_dir())(text.read_text())["input_ids"]
    windows = [ids[i * length:(i + 1) * length] for i in range(n_windows)]
    start = n_windows * length
    return windows, [ids[start + i * 64:start + i * 64 + 32] for i in range(n_prompts)]


def case_dir(case: Case) -> str:
    return f"{case.name}-{case.dtype}".replace(" ", "_").replace("+", "plus")


def build(case: Case, out: Path, texts: Path) -> Path:
    """Quantise the embedded model for CASE into OUT (overwritten if quantkit wrote it)."""
    from ..job import quantize_to_checkpoint
    from ..recipe import Recipe, apply_overrides

    # a case names its method when it is not RTN; the default (auto) would calibrate, and change what a case means
    values = {"quant.method": "rtn",
              **{k: (v.format(texts=texts) if isinstance(v, str) else v) for k, v in case.overrides.items()}}
    values.update({"output": str(out), "overwrite": True, "dtype": case.dtype})
    recipe = apply_overrides(Recipe(), values)
    if case.targets:
        recipe = apply_overrides(recipe, {"quant.targets": case.targets})
    quantize_to_checkpoint(recipe)
    return out


def run(cases: list[Case], paths: list[Path], windows, prompts, max_new: int, vllm_python: str) -> list[dict]:
    """One row per case: transformers' and vLLM's scores and how far apart they are."""
    # transformers has no FP8 KV cache: the format is checked with vLLM's cache in the model dtype, and the
    # FP8 cache is scored on its own beside it (a second job, the checkpoint's k_scale/v_scale in use)
    # (vLLM turns the FP8 cache on by itself for a checkpoint with a kv_cache_scheme: the model dtype is asked
    # for by name)
    jobs = [{"model": str(p), "dtype": c.dtype, "windows": windows, "prompts": prompts if c.cpu else [],
             "max_new": max_new, "kv_cache_dtype": c.dtype if c.kv_cache_dtype else None}
            for c, p in zip(cases, paths)]
    cpu = [i for i, c in enumerate(cases) if c.cpu]
    kv = [i for i in cpu if cases[i].kv_cache_dtype]
    extra = [{**jobs[i], "prompts": [], "kv_cache_dtype": cases[i].kv_cache_dtype} for i in kv]
    answers = score_vllm([jobs[i] for i in cpu] + extra, vllm_python)
    served = dict(zip(cpu, answers))
    kv_scores = dict(zip(kv, answers[len(cpu):]))
    for i, c in enumerate(cases):  # each in a worker of its own: the CPU build can hang on a GPU-only scheme
        if not c.cpu:
            served[i] = score_vllm([jobs[i]], vllm_python, timeout=GPU_ONLY_TIMEOUT)[0]
    served = [served[i] for i in range(len(cases))]
    rows = []
    for case, path, vl in zip(cases, paths, served):
        score_ref = score_quantkit if case.reference == "quantkit" else score_transformers
        ref = score_ref(str(path), windows, prompts, max_new, case.dtype) if case.cpu or vl.ok \
            else Scores("transformers", False, error="not scored: vLLM refused the checkpoint")
        row = {"case": case.name, "dtype": case.dtype, "cpu_kernel": case.cpu, "path": str(path),
               "reference": case.reference,
               "transformers_ppl": ref.perplexity, "vllm": compare(ref, vl), "vllm_error": vl.error}
        if case.kv_cache_dtype:
            k = kv_scores[cases.index(case)]
            row["vllm_kv"] = {"kv_cache_dtype": case.kv_cache_dtype, "ok": k.ok, "ppl": k.perplexity,
                              "error": k.error}
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    head = ("| checkpoint | served in | transformers ppl | vLLM ppl | Δ ppl | mean abs Δ log p | greedy tokens equal |\n"
            "|---|---|---:|---:|---:|---:|---|\n")
    lines = []
    for r in rows:
        v = r["vllm"]
        if v["ok"]:
            case = r["case"] + (" (reference: quantkit's runtime)" if r.get("reference") == "quantkit" else "")
            lines.append(f"| {case} | {r['dtype']} | {r['transformers_ppl']:.4f} | {v['ppl']:.4f} | "
                         f"{100 * v['ppl_rel']:+.3f}% | {v['logprob_mean_abs']:.4f} | {_greedy_cell(v)} |")
            k = r.get("vllm_kv")
            if k and k["ok"]:
                lines.append(f"| ↳ same, vLLM `kv_cache_dtype={k['kv_cache_dtype']}` (checkpoint's k/v scales) | "
                             f"{r['dtype']} | - | {k['ppl']:.4f} | {100 * (k['ppl'] / v['ppl'] - 1):+.3f}% vs its "
                             f"own model-dtype cache | | |")
        else:
            why = (r["vllm_error"] or v.get("error") or "?").replace("|", "/")[:160]
            lines.append(f"| {r['case']} | {r['dtype']} | - | GPU-only on vLLM: {why} | | | |")
    return head + "\n".join(lines) + "\n"


def _greedy_cell(v: dict) -> str:
    """Tokens equal per prompt; where they part before 16, the reference's top-1/top-2 gap there (nats)."""
    cells = []
    for a, m in zip(v["greedy_agree"], v["parting_margin"]):
        cells.append(str(a) if m is None else f"{a} (tie gap {m:.3f})")
    return ", ".join(cells) or "-"
