"""The vLLM acceptance matrix: every checkpoint option quantkit writes, scored by vLLM and by transformers.

A checkpoint is right when the engines people serve with load it and score it as transformers does, in the
dtype it will be served in. For each case this writes a checkpoint of the embedded SmolLM2-135M (scales in
the serving dtype), scores the same token windows and greedy prompts in both engines and compares. Schemes
vLLM's CPU build has no kernel for are still offered to it, and what it answers is recorded as GPU-only.
Used by tests/test_vllm_interop.py (the gate) and `python -m bench interop` (the table in docs/vllm.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from .backends import Scores, compare, score_quantkit, score_transformers, score_vllm

# the guards' hold-out off: what is checked here is the layout vLLM reads, not which rounding a guard keeps
CALIB = {"calibration.spec": "{texts}/prose_calib.txt", "calibration.num_samples": 8, "calibration.seq_len": 128,
         "calibration.holdout": 0.0}
# AWQ's format is what is checked here, not its search: a coarse grid on few tokens keeps CI short
AWQ_FAST = {"quant.awq.grid": 5, "quant.awq.search_tokens": 512}
# A scheme with no fast CPU kernel known is offered to vLLM with one short window, after every other job of the
# same worker and with a time limit of its own: its CPU build may refuse it at load (8-bit weight-only), or run
# it on a reference GEMM (FP8 through oneDNN's ref:any matmul: about 2 s per token on a 2-core Xeon), or hang;
# the limit turns a hang into an answer, and coming last, a hang costs no other case its answer.
PROBE_TOKENS = 32
PROBE_TIMEOUT = 300  # seconds
MIXED = [{"match": "re:.*mlp\\.down_proj", "scheme": "w4a16", "group_size": 32}]


@dataclass(frozen=True)
class Case:
    name: str
    overrides: dict
    dtype: str = "float16"  # written and served in
    # no fast CPU kernel is known: vLLM is asked with one PROBE_TOKENS window and no greedy prompts (see above);
    # whether it runs it or refuses is what it answers, never assumed from the scheme
    probe: bool = False
    kv_cache_dtype: str | None = None
    targets: list = field(default_factory=list)
    # the engine vLLM is compared with: transformers, or quantkit's runtime where transformers' compressed-tensors
    # forward rounds activations by another rule (W8A8: absmax/127.5 per token against vLLM's and quantkit's /127,
    # 1-2% perplexity apart on SmolLM2, whose int8 activations amplify any rounding change)
    reference: str = "transformers"
    # in the test suite's gate; False: a layout a gated case already loads (the same packed tensors and config,
    # another solver or dtype), scored for the full table by `python -m bench interop` only, to keep CI short
    gate: bool = True
    # token windows of 128 scored; quantised activations need more (see ppl_bound)
    windows: int = 4


W8A8_WINDOWS = 16
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
    # for float16 activations ("scale_C: scalar path not implemented", sgl-kernels/gemm_int8.cpp). Which kernel
    # runs depends on the CPU (AMX: the SGL kernel; without: oneDNN); each row records vLLM's own choice. SmoothQuant
    # with a fixed alpha: the format is checked here, not the search, which would cost minutes
    Case("w8a8 rtn", {"quant.scheme": "w8a8"}, dtype="bfloat16", reference="quantkit", windows=W8A8_WINDOWS),
    Case("w8a8 smooth 0.5 rtn",
         {"quant.scheme": "w8a8", "quant.smooth": True, "quant.smoothquant.alpha": 0.5, **CALIB},
         dtype="bfloat16", reference="quantkit", windows=W8A8_WINDOWS),
    # static per-tensor input scales: vLLM 0.32's CPU build loads it but scores 2.8% below both quantkit and
    # transformers (43.36 against 44.60 / 44.78), near its dynamic per-token score of the same weights (43.76):
    # its x86 SGL int8 kernel quantises activations per token and never reads input_scale (docs/vllm.md), so
    # this row is documented, not gated
    Case("w8a8-static smooth 0.5 rtn", {"quant.scheme": "w8a8-static", "quant.smooth": True,
                                        "quant.smoothquant.alpha": 0.5, **CALIB},
         dtype="bfloat16", reference="quantkit", gate=False, windows=W8A8_WINDOWS),
    Case("w8 channel rtn", {"quant.scheme": "w8a16", "quant.group_size": -1}, probe=True),
    # FP8 activations are rounded per token by both engines compared: quantkit's runtime is the reference
    Case("fp8 dynamic", {"quant.scheme": "fp8-dynamic"}, probe=True, reference="quantkit"),
]
GATED = [c for c in CASES if c.gate]  # the cases tests/test_vllm_interop.py runs


def eval_tokens(text: Path, n_windows: int = W8A8_WINDOWS, length: int = 128, n_prompts: int = 2):
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


def run(cases: list[Case], paths: list[Path], windows, prompts, max_new: int, vllm_python: str,
        no_amx: bool = False, controls: dict | None = None) -> list[dict]:
    """One row per case: the reference's and vLLM's scores, how far apart they are, and the kernel vLLM chose.
    WINDOWS: at least max(case.windows) of them. NO_AMX: vLLM as on a CPU without AMX (backends.NO_AMX_ENV).
    CONTROLS: {case index: path of a damaged copy of its checkpoint}; vLLM scores the copy in the same worker and
    row["control"] compares it with the reference's scores of the intact one (a gate must fail it)."""
    controls = controls or {}
    jobs = [_job(c, p, windows, prompts, max_new) for c, p in zip(cases, paths)]
    served_here = [i for i, c in enumerate(cases) if not c.probe]
    kv = [i for i in served_here if cases[i].kv_cache_dtype]
    # transformers has no FP8 KV cache: the format is checked with vLLM's cache in the model dtype (asked for by
    # name: vLLM turns the FP8 cache on by itself for a checkpoint with a kv_cache_scheme), and the FP8 cache
    # with the checkpoint's k_scale/v_scale is scored beside it as a second job
    extra = [{**jobs[i], "prompts": [], "kv_cache_dtype": cases[i].kv_cache_dtype} for i in kv]
    extra += [{**jobs[i], "model": str(controls[i]), "prompts": []} for i in controls]
    probed = [i for i, c in enumerate(cases) if c.probe]
    probes = [{**jobs[i], "timeout_s": PROBE_TIMEOUT} for i in probed]
    answers = score_vllm([jobs[i] for i in served_here] + extra + probes, vllm_python,
                         timeout=3600 + PROBE_TIMEOUT * len(probes), no_amx=no_amx)
    served = dict(zip(served_here, answers))
    kv_scores = dict(zip(kv, answers[len(served_here):]))
    control_scores = dict(zip(controls, answers[len(served_here) + len(kv):]))
    served.update(zip(probed, answers[len(served_here) + len(extra):]))
    rows = []
    for i, (case, path) in enumerate(zip(cases, paths)):
        vl, job = served[i], jobs[i]
        score_ref = score_quantkit if case.reference == "quantkit" else score_transformers
        ref = score_ref(str(path), job["windows"], job["prompts"], max_new, case.dtype) if vl.ok \
            else Scores(case.reference, False, error="not scored: vLLM did not score the checkpoint")
        row = {"case": case.name, "dtype": case.dtype, "probe": case.probe, "path": str(path),
               "reference": case.reference, "transformers_ppl": ref.perplexity, "vllm": compare(ref, vl),
               "vllm_error": vl.error, "kernels": vl.kernels, "cpu": "no AMX (emulated)" if no_amx else "native"}
        if i in kv_scores:
            k = kv_scores[i]
            row["vllm_kv"] = {"kv_cache_dtype": case.kv_cache_dtype, "ok": k.ok, "ppl": k.perplexity,
                              "error": k.error}
        if i in control_scores:
            row["control"] = compare(ref, control_scores[i])
        rows.append(row)
    return rows


def _job(case: Case, path: Path, windows, prompts, max_new: int) -> dict:
    if case.probe:
        return {"model": str(path), "dtype": case.dtype, "windows": [windows[0][:PROBE_TOKENS]], "prompts": [],
                "max_new": 0, "kv_cache_dtype": None}
    return {"model": str(path), "dtype": case.dtype, "windows": windows[:case.windows], "prompts": prompts,
            "max_new": max_new, "kv_cache_dtype": case.dtype if case.kv_cache_dtype else None}


def ppl_bound(case: Case, cmp: dict) -> float:
    """The largest |log(vLLM ppl / reference ppl)| that still counts as the same model.

    Weight-only in float16/bfloat16: 0.5%; the engines differ only by their summation order. With quantised
    activations (W8A8, FP8) a rounding difference anywhere before a Linear (an attention or norm kernel one ulp
    apart) flips some activation codes, and SmolLM2's outlier channels turn each flip into a visible per-token
    change: measured per-token sd of the log-prob difference 0.31 nats in bfloat16, on both of vLLM's int8 paths
    (AMX SGL kernel and oneDNN), against quantkit's runtime, which rounds each Linear's input as both do (absmax /
    127, codes and scales equal to oneDNN's quantiser's). That noise is unbiased (mean +-0.003 over 2,032 tokens),
    so the gate is three standard errors of the paired mean: 2.1% at 2,032 tokens (measured gaps: -0.16% AMX,
    -0.26% oneDNN). With 508 tokens the same noise put the oneDNN path 1.5% away, past a fixed 0.5% bound: the
    failure seen on an AMD EPYC. A misread scale costs far more (one down_proj scale tensor 1.25x: +14%)."""
    if case.reference == "transformers":
        return math.log(1.005)
    return max(math.log(1.005), 3 * cmp["nll_diff_se"])


def failures(case: Case, cmp: dict) -> list[str]:
    """Why vLLM's scores are not the reference's, one reason per entry; [] when they agree."""
    if not cmp["ok"]:
        return [f"not scored: {cmp.get('error')}"]
    found = []
    diff, bound = math.log(1 + cmp["ppl_rel"]), ppl_bound(case, cmp)
    if abs(diff) > bound:
        found.append(f"perplexity {cmp['ppl']:.4f} against {cmp['ref_ppl']:.4f}: log ratio {diff:+.4f}, "
                     f"bound {bound:.4f}")
    # per token: the engines' summation orders differ (measured 0.006 in float16, 0.04-0.05 in bfloat16) and a
    # wrong scale or zero point moves every token by far more; with quantised activations the flips above
    # dominate (measured 0.21-0.23 in bfloat16, 0.12-0.16 for FP8 in float16)
    limit = 0.3 if case.reference == "quantkit" else (0.02 if case.dtype == "float16" else 0.08)
    if cmp["logprob_mean_abs"] >= limit:
        found.append(f"mean |Δ log p| {cmp['logprob_mean_abs']:.4f} >= {limit}")
    # 16 equal greedy tokens, or a parting where the reference's top two were a near-tie
    if case.dtype == "float16" and case.reference == "transformers" and not cmp["greedy_ok"]:
        found.append(f"greedy tokens part at {cmp['greedy_agree']}, gaps {cmp['parting_margin']}")
    return found


def markdown(rows: list[dict]) -> str:
    head = ("| checkpoint | served in | vLLM kernel (its choice) | reference ppl | vLLM ppl | Δ ppl | mean abs Δ log p | "
            "greedy tokens equal |\n|---|---|---|---:|---:|---:|---:|---|\n")
    lines = []
    for r in rows:
        v = r["vllm"]
        kernel = kernel_cell(r.get("kernels") or {})
        if v["ok"]:
            case = r["case"] + (" (reference: quantkit's runtime)" if r.get("reference") == "quantkit" else "")
            lines.append(f"| {case} | {r['dtype']} | {kernel} | {r['transformers_ppl']:.4f} | {v['ppl']:.4f} | "
                         f"{100 * v['ppl_rel']:+.3f}% | {v['logprob_mean_abs']:.4f} | {_greedy_cell(v)} |")
            k = r.get("vllm_kv")
            if k and k["ok"]:
                lines.append(f"| ↳ same, vLLM `kv_cache_dtype={k['kv_cache_dtype']}` (checkpoint's k/v scales) | "
                             f"{r['dtype']} | | - | {k['ppl']:.4f} | {100 * (k['ppl'] / v['ppl'] - 1):+.3f}% vs its "
                             f"own model-dtype cache | | |")
        else:
            why = (r["vllm_error"] or v.get("error") or "?").replace("|", "/")[:160]
            lines.append(f"| {r['case']} | {r['dtype']} | {kernel} | - | refused by vLLM's CPU build: {why} | | | |")
    return head + "\n".join(lines) + "\n"


def kernel_cell(kernels: dict) -> str:
    """The quantised Linears' kernels, short: 'CPUInt8ScaledMMLinearKernel/sgl x120'."""
    quantised = {k.split("/", 2)[-1]: n for k, n in kernels.items() if k.split("/")[1] != "-"} if kernels else {}
    return ", ".join(f"{k} x{n}" for k, n in quantised.items()) or "-"


def _greedy_cell(v: dict) -> str:
    """Tokens equal per prompt; where they part before 16, the reference's top-1/top-2 gap there (nats)."""
    cells = []
    for a, m in zip(v["greedy_agree"], v["parting_margin"]):
        cells.append(str(a) if m is None else f"{a} (tie gap {m:.3f})")
    return ", ".join(cells) or "-"
