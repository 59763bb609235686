"""What the two vLLM acceptance files share (tests/test_vllm_interop.py: the native matrix;
tests/test_vllm_interop_no_amx.py: int8 activations as on a CPU without AMX, and the FP8 KV scales): checkpoint
building with damaged copies for the negative controls, and scoring (their fixtures vllm_python and
vllm_tokens are in conftest.py).
Two files so that `-n 2 --dist loadfile` runs them side by side: each is minutes of one vLLM worker."""
from __future__ import annotations

import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from quantkit.evaluate import interop
from quantkit.shipped import shipped_dir

ROOT = Path(__file__).resolve().parents[1]
# the last decoder layer's down_proj scales 1.25x: a mild misread next to a layout error (the gate's bounds
# are 0.5-2%; this costs about 14% perplexity on SmolLM2 W8A8)
DAMAGED = "model.layers.29.mlp.down_proj.weight_scale"


def case_id(case) -> str:
    return interop.case_dir(case)


def find_case(name: str, dtype: str):
    return next(c for c in interop.GATED if c.name == name and c.dtype == dtype)


def build(cases, damaged: list, out: Path) -> dict:
    """{case id: checkpoint} for CASES, and {case id + '-damaged': copy with DAMAGED 1.25x} for those in DAMAGED."""
    texts = shipped_dir("calibration") / "texts"
    built = {case_id(c): interop.build(c, out / case_id(c), texts) for c in cases}
    for case in damaged:
        key = case_id(case)
        copy = out / f"{key}-damaged"
        shutil.copytree(built[key], copy)
        tensors = load_file(copy / "model.safetensors")
        tensors[DAMAGED] = tensors[DAMAGED] * 1.25
        save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
        built[f"{key}-damaged"] = copy
    return built


def score(cases, damaged: list, checkpoints, tokens, vllm_python, cpu: str) -> dict:
    """{case id: row} scored by vLLM on CPU ('native', or 'no-amx': as on a CPU without AMX)."""
    windows, prompts = tokens
    controls = {cases.index(c): checkpoints[f"{case_id(c)}-damaged"] for c in damaged}
    rows = interop.run(cases, [checkpoints[case_id(c)] for c in cases], windows, prompts, 16, vllm_python,
                       no_amx=cpu == "no-amx", controls=controls)
    report = ROOT / "bench" / "out" / f"vllm-interop-{cpu}.md"
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(interop.markdown(rows))  # the table CI shows; docs/vllm.md carries a copy
    return {case_id(c): r for c, r in zip(cases, rows)}
