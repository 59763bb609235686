"""vLLM's acceptance test, second file (tests/test_vllm_interop.py has the native matrix; a file of its own so
that pytest-xdist runs it beside that one): the int8-activation cases as on a CPU without AMX, with their
negative control, and the FP8 KV cache's k/v scales read by vLLM.

vLLM is told the CPU has no AMX tiles and oneDNN is capped to AVX-512 with VNNI and BF16 (backends.NO_AMX_ENV),
so it selects and runs the int8 GEMM an AMD EPYC runs (oneDNN, not the AMX SGL kernel); on such a CPU that is
its native path already. The gate is the native file's: interop.failures against quantkit's runtime.
"""
from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from interop_support import build, case_id, find_case, score
from quantkit.evaluate import interop
from quantkit.evaluate.backends import score_vllm

pytestmark = pytest.mark.vllm
W8A8 = [c for c in interop.GATED if c.name.startswith("w8a8")]
CONTROL = find_case("w8a8 rtn", "bfloat16")
KV = next(c for c in interop.GATED if c.kv_cache_dtype == "fp8")


@pytest.fixture(scope="module")
def rows_no_amx(tmp_path_factory, vllm_tokens, vllm_python) -> dict:
    checkpoints = build(W8A8, [CONTROL], tmp_path_factory.mktemp("interop-no-amx"))
    return score(W8A8, [CONTROL], checkpoints, vllm_tokens, vllm_python, "no-amx")


@pytest.mark.parametrize("case", W8A8, ids=case_id)
def test_int8_activations_on_the_path_a_cpu_without_amx_takes(rows_no_amx, case):
    """vLLM's int8 GEMM without AMX is oneDNN's (the kernel path read off vLLM's model shows the emulation took
    effect); its scores are gated exactly as the native path's are."""
    r = rows_no_amx[case_id(case)]
    assert r["vllm"]["ok"], f"vLLM did not load {case.name}: {r['vllm_error']}"
    int8 = [k for k in r["kernels"] if "Int8" in k]
    assert int8 and all(k.endswith("/onednn") for k in int8), r["kernels"]
    assert not interop.failures(case, r["vllm"]), interop.failures(case, r["vllm"])


def test_one_damaged_scale_tensor_fails_the_gate_without_amx(rows_no_amx):
    r = rows_no_amx[case_id(CONTROL)]
    assert r["control"]["ok"], r["control"]
    assert interop.failures(CONTROL, r["control"]), (r["vllm"], r["control"])


def test_fp8_kv_scales_reach_vllm(vllm_tokens, vllm_python, tmp_path):
    """Our k_scale/v_scale are read: the same checkpoint with the scales 64x too small scores worse in vLLM's
    FP8 KV cache (keys and values saturate the FP8 grid), so vLLM does use the scales it is given."""
    good = build([KV], [], tmp_path)[case_id(KV)]
    bad = tmp_path / "bad-scales"
    shutil.copytree(good, bad)
    tensors = load_file(bad / "model.safetensors")
    scaled = [k for k in tensors if k.endswith((".k_scale", ".v_scale"))]
    assert scaled, "the fp8 KV case wrote no k_scale/v_scale"
    for k in scaled:
        tensors[k] = tensors[k] / 64
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    windows, _ = vllm_tokens
    job = {"dtype": KV.dtype, "windows": windows[:KV.windows], "prompts": [], "max_new": 0, "kv_cache_dtype": "fp8"}
    ok, broken = score_vllm([{**job, "model": str(good)}, {**job, "model": str(bad)}], vllm_python)
    assert ok.ok and broken.ok, (ok.error, broken.error)
    assert broken.perplexity > ok.perplexity * 1.02, (ok.perplexity, broken.perplexity)
    assert json.loads((good / "config.json").read_text())["quantization_config"]["kv_cache_scheme"]["num_bits"] == 8
