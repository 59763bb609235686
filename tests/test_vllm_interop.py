"""vLLM is the acceptance test: every checkpoint option quantkit writes, loaded and scored by vLLM's CPU build.

The gated cases (interop.GATED) cover every distinct layout; the few cases that repeat one (another solver or
serving dtype over the same tensors and config) are scored only by `python -m bench interop`'s full table.

vLLM runs in its own venv (bench/vllm_env.sh makes it when QUANTKIT_VLLM_PYTHON does not name one; the README's
test command makes it first). For each case of quantkit/evaluate/interop.py the embedded SmolLM2-135M is
quantised with its scales in the serving dtype, then vLLM and the reference (transformers, or quantkit's runtime
for quantised activations) score the same windows and continue the same prompts; interop.failures is the gate.

vLLM picks its kernels by CPU (int8 activations: the AMX SGL kernel or oneDNN; FP8: an AMX-FP8 kernel or
torch's scaled matmul), so every row records the kernel vLLM itself chose, read off its loaded model. On a CPU
with AMX the W8A8 cases run a second time as on one without (backends.NO_AMX_ENV), so both x86 paths are gated
on every machine. Schemes with no fast CPU kernel known are offered all the same: vLLM either scores them, and
they are gated like the rest, or refuses them with its own message. Each gated kernel path has a negative
control: the same checkpoint with one scale tensor 1.25x, scored by vLLM against the reference's scores of the
intact one, must fail the gate.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantkit.evaluate import interop
from quantkit.evaluate.backends import score_vllm
from quantkit.shipped import shipped_dir

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[1]
SERVED = [c for c in interop.GATED if not c.probe]
PROBED = [c for c in interop.GATED if c.probe]
W8A8 = [c for c in interop.GATED if c.name.startswith("w8a8")]
HAS_AMX = torch.cpu._is_amx_tile_supported()
# (cpu, case name, dtype): one per kernel path vLLM runs for what quantkit writes: grouped 4-bit with zero
# points in float16, 4-bit in bfloat16, int8 activations natively and as on a CPU without AMX
CONTROLS = [("native", "w4 g32 asym rtn", "float16"), ("native", "w4 g64 sym rtn", "bfloat16"),
            ("native", "w8a8 rtn", "bfloat16"), ("no-amx", "w8a8 rtn", "bfloat16")]
# the last decoder layer's down_proj scales 1.25x: a mild misread next to a layout error (the gate's bounds
# are 0.5-2%; this costs about 14% perplexity on SmolLM2 W8A8)
DAMAGED = "model.layers.29.mlp.down_proj.weight_scale"


def _id(case) -> str:
    return interop.case_dir(case)


def _case(name: str, dtype: str):
    return next(c for c in interop.GATED if c.name == name and c.dtype == dtype)


@pytest.fixture(scope="module")
def vllm_python() -> str:
    explicit = os.environ.get("QUANTKIT_VLLM_PYTHON")
    if explicit:
        return explicit
    proc = subprocess.run(["bash", str(ROOT / "bench" / "vllm_env.sh")], capture_output=True, text=True,
                          timeout=1800, cwd=ROOT)
    assert proc.returncode == 0, f"bench/vllm_env.sh failed:\n{proc.stderr[-3000:]}"
    return proc.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def tokens():
    return interop.eval_tokens(ROOT / "bench" / "data" / "eval_prose.txt")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("interop")
    texts = shipped_dir("calibration") / "texts"
    built = {_id(c): interop.build(c, out / _id(c), texts) for c in interop.GATED}
    for _, name, dtype in CONTROLS:
        key = _id(_case(name, dtype))
        damaged = out / f"{key}-damaged"
        if not damaged.exists():
            shutil.copytree(built[key], damaged)
            tensors = load_file(damaged / "model.safetensors")
            tensors[DAMAGED] = tensors[DAMAGED] * 1.25
            save_file(tensors, damaged / "model.safetensors", metadata={"format": "pt"})
        built[f"{key}-damaged"] = damaged
    return built


def _score(cases, checkpoints, tokens, vllm_python, cpu: str) -> dict:
    windows, prompts = tokens
    controls = {cases.index(_case(n, d)): checkpoints[f"{_id(_case(n, d))}-damaged"]
                for c, n, d in CONTROLS if c == cpu}
    rows = interop.run(cases, [checkpoints[_id(c)] for c in cases], windows, prompts, 16, vllm_python,
                       no_amx=cpu == "no-amx", controls=controls)
    report = ROOT / "bench" / "out" / f"vllm-interop-{cpu}.md"
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(interop.markdown(rows))  # the table CI shows; docs/vllm.md carries a copy
    return {_id(c): r for c, r in zip(cases, rows)}


@pytest.fixture(scope="module")
def rows(checkpoints, tokens, vllm_python) -> dict:
    return _score(interop.GATED, checkpoints, tokens, vllm_python, "native")


@pytest.fixture(scope="module")
def rows_no_amx(checkpoints, tokens, vllm_python, rows) -> dict:
    """The int8-activation cases as on a CPU without AMX; on such a CPU the native rows are that already."""
    return _score(W8A8, checkpoints, tokens, vllm_python, "no-amx") if HAS_AMX else rows


@pytest.mark.parametrize("case", SERVED, ids=_id)
def test_vllm_scores_the_checkpoint_as_the_reference_does(rows, case):
    r = rows[_id(case)]
    assert r["vllm"]["ok"], f"vLLM did not load {case.name}: {r['vllm_error']}"
    assert interop.kernel_cell(r["kernels"]) != "-", f"vLLM reported no kernel for the quantised Linears: {r}"
    assert not interop.failures(case, r["vllm"]), (interop.failures(case, r["vllm"]), r["kernels"])


@pytest.mark.parametrize("case", W8A8, ids=_id)
def test_int8_activations_on_the_path_a_cpu_without_amx_takes(rows_no_amx, case):
    """vLLM's int8 GEMM without AMX is oneDNN's (the kernel path read off vLLM's model shows the emulation took
    effect); its scores are gated exactly as the native path's are."""
    r = rows_no_amx[_id(case)]
    assert r["vllm"]["ok"], f"vLLM did not load {case.name}: {r['vllm_error']}"
    int8 = [k for k in r["kernels"] if "Int8" in k]
    assert int8 and all(k.endswith("/onednn") for k in int8), r["kernels"]
    assert not interop.failures(case, r["vllm"]), interop.failures(case, r["vllm"])


@pytest.mark.parametrize("case", PROBED, ids=_id)
def test_a_scheme_is_scored_where_vllm_runs_it_and_refused_in_its_own_words_where_not(rows, case):
    """Whether vLLM's CPU build runs a scheme depends on the CPU and the build (FP8 runs on oneDNN's reference
    matmul on a Xeon; 8-bit weight-only finds no kernel): what it did is asked, never assumed from the name."""
    r = rows[_id(case)]
    if r["vllm"]["ok"]:
        assert not interop.failures(case, r["vllm"]), (interop.failures(case, r["vllm"]), r["kernels"])
    else:
        assert r["vllm_error"] and "Traceback" not in r["vllm_error"], r
        assert "no answer within" not in r["vllm_error"], f"vLLM neither scored nor refused {case.name}: {r}"


@pytest.mark.parametrize("cpu,name,dtype", CONTROLS)
def test_one_damaged_scale_tensor_fails_the_gate(rows, rows_no_amx, cpu, name, dtype):
    case = _case(name, dtype)
    r = (rows_no_amx if cpu == "no-amx" else rows)[_id(case)]
    assert r["control"]["ok"], r["control"]
    assert interop.failures(case, r["control"]), (r["vllm"], r["control"])


def test_fp8_kv_cache_runs_in_vllm_and_costs_little(rows):
    """transformers has no FP8 KV cache, so the format row above ran vLLM's cache in the model dtype; the FP8
    cache with the checkpoint's scales is scored beside it (measured: +4.1% perplexity on this CPU build, whose
    prefill reads the quantised cache; quantkit's runtime: +1.4%)."""
    r = rows[_id(next(c for c in SERVED if c.kv_cache_dtype == "fp8"))]
    k = r["vllm_kv"]
    assert k["ok"], k["error"]
    assert r["vllm"]["ppl"] <= k["ppl"] < r["vllm"]["ppl"] * 1.06, (r["vllm"]["ppl"], k["ppl"])


def test_fp8_kv_scales_reach_vllm(checkpoints, rows, tokens, vllm_python, tmp_path):
    """Our k_scale/v_scale are read: the same checkpoint with the scales 64x too small scores worse in vLLM
    (keys and values saturate the FP8 grid), so vLLM does use the scales it is given."""
    case = next(c for c in SERVED if c.kv_cache_dtype == "fp8")
    good = checkpoints[_id(case)]
    bad = tmp_path / "bad-scales"
    shutil.copytree(good, bad)
    tensors = load_file(bad / "model.safetensors")
    scaled = [k for k in tensors if k.endswith((".k_scale", ".v_scale"))]
    assert scaled, "the fp8 KV case wrote no k_scale/v_scale"
    for k in scaled:
        tensors[k] = tensors[k] / 64
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    windows, _ = tokens
    job = {"dtype": case.dtype, "windows": windows[:case.windows], "prompts": [], "max_new": 0,
           "kv_cache_dtype": "fp8"}
    ok = rows[_id(case)]["vllm_kv"]  # the same job on the good checkpoint, scored by the fixture's worker
    broken, = score_vllm([{**job, "model": str(bad)}], vllm_python)
    assert ok["ok"] and broken.ok, (ok["error"], broken.error)
    assert broken.perplexity > ok["ppl"] * 1.02, (ok["ppl"], broken.perplexity)
    assert json.loads((good / "config.json").read_text())["quantization_config"]["kv_cache_scheme"]["num_bits"] == 8
