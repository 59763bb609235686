"""vLLM is the acceptance test: every checkpoint option quantkit writes, loaded and scored by vLLM's CPU build.

The gated cases (interop.GATED) cover every distinct layout; the few cases that repeat one (another solver or
serving dtype over the same tensors and config) are scored only by `python -m bench interop`'s full table.

vLLM runs in its own venv (bench/vllm_env.sh makes it when QUANTKIT_VLLM_PYTHON does not name one; the README's
test command makes it first). For each case of quantkit/evaluate/interop.py the embedded SmolLM2-135M is
quantised with its scales in the serving dtype, then vLLM and the reference (transformers, or quantkit's runtime
for quantised activations) score the same windows and continue the same prompts; interop.failures is the gate.

vLLM picks its kernels by CPU (int8 activations: the AMX SGL kernel or oneDNN; FP8: an AMX-FP8 kernel or
torch's scaled matmul), so every row records the kernel vLLM itself chose, read off its loaded model. The W8A8
cases also run as on a CPU without AMX (backends.NO_AMX_ENV), so both x86 paths are gated on every machine:
tests/test_vllm_interop_no_amx.py, a file of its own so that pytest-xdist runs it beside this one. Schemes with no fast CPU kernel known are offered all the same: vLLM either scores them, and
they are gated like the rest, or refuses them with its own message. Each gated kernel path has a negative
control: the same checkpoint with one scale tensor 1.25x, scored by vLLM against the reference's scores of the
intact one, must fail the gate.
"""
from __future__ import annotations

import pytest

from interop_support import build, case_id, find_case, score
from quantkit.evaluate import interop

pytestmark = pytest.mark.vllm
SERVED = [c for c in interop.GATED if not c.probe]
PROBED = [c for c in interop.GATED if c.probe]
# one per kernel path vLLM runs natively for what quantkit writes: grouped 4-bit with zero points in float16,
# 4-bit in bfloat16, int8 activations (the path without AMX: tests/test_vllm_interop_no_amx.py)
CONTROLS = [find_case("w4 g32 asym rtn", "float16"), find_case("w4 g64 sym rtn", "bfloat16"),
            find_case("w8a8 rtn", "bfloat16")]


@pytest.fixture(scope="module")
def rows(tmp_path_factory, vllm_tokens, vllm_python) -> dict:
    checkpoints = build(interop.GATED, CONTROLS, tmp_path_factory.mktemp("interop"))
    return score(interop.GATED, CONTROLS, checkpoints, vllm_tokens, vllm_python, "native")


@pytest.mark.parametrize("case", SERVED, ids=case_id)
def test_vllm_scores_the_checkpoint_as_the_reference_does(rows, case):
    r = rows[case_id(case)]
    assert r["vllm"]["ok"], f"vLLM did not load {case.name}: {r['vllm_error']}"
    assert interop.kernel_cell(r["kernels"]) != "-", f"vLLM reported no kernel for the quantised Linears: {r}"
    assert not interop.failures(case, r["vllm"]), (interop.failures(case, r["vllm"]), r["kernels"])


@pytest.mark.parametrize("case", PROBED, ids=case_id)
def test_a_scheme_is_scored_where_vllm_runs_it_and_refused_in_its_own_words_where_not(rows, case):
    """Whether vLLM's CPU build runs a scheme depends on the CPU and the build (FP8 runs on oneDNN's reference
    matmul on a Xeon; 8-bit weight-only finds no kernel): what it did is asked, never assumed from the name."""
    r = rows[case_id(case)]
    if r["vllm"]["ok"]:
        assert not interop.failures(case, r["vllm"]), (interop.failures(case, r["vllm"]), r["kernels"])
    else:
        assert r["vllm_error"] and "Traceback" not in r["vllm_error"], r
        assert "no answer within" not in r["vllm_error"], f"vLLM neither scored nor refused {case.name}: {r}"


@pytest.mark.parametrize("case", CONTROLS, ids=case_id)
def test_one_damaged_scale_tensor_fails_the_gate(rows, case):
    r = rows[case_id(case)]
    assert r["control"]["ok"], r["control"]
    assert interop.failures(case, r["control"]), (r["vllm"], r["control"])


def test_fp8_kv_cache_runs_in_vllm_and_costs_little(rows):
    """transformers has no FP8 KV cache, so the format row above ran vLLM's cache in the model dtype; the FP8
    cache with the checkpoint's scales is scored beside it (measured: +4.1% perplexity on this CPU build, whose
    prefill reads the quantised cache; quantkit's runtime: +1.4%)."""
    r = rows[case_id(next(c for c in SERVED if c.kv_cache_dtype == "fp8"))]
    k = r["vllm_kv"]
    assert k["ok"], k["error"]
    assert r["vllm"]["ppl"] <= k["ppl"] < r["vllm"]["ppl"] * 1.06, (r["vllm"]["ppl"], k["ppl"])
