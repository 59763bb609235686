"""Issue 40.5: `quantkit inspect` and `quantkit eval` read GGUF files. inspect reports each tensor kind's llama.cpp
types, bits per weight and bytes, checked against ggml's block sizes as llama.cpp's ggml-common.h defines them;
eval scores a GGUF variant as the float model of its weights dequantised (transformers' GGUF loader), which must
equal quantkit's own decode of the same blocks (itself held bit for bit to llama.cpp's, test_gguf_llama_cpp.py)."""
from __future__ import annotations

import json

import pytest
import torch

from test_gguf_export import tiny_src  # noqa: F401  (the module's fixture: a tiny Llama with a byte-level BPE)

# bits per weight of each block type, scales included: block bytes x 8 / weights per block (ggml-common.h)
SPEC_BITS = {"F32": 32.0, "F16": 16.0, "Q8_0": 34 * 8 / 32, "Q4_0": 18 * 8 / 32, "Q4_1": 20 * 8 / 32,
             "Q5_0": 22 * 8 / 32, "Q5_1": 24 * 8 / 32, "Q3_K": 110 * 8 / 256, "Q4_K": 144 * 8 / 256,
             "Q5_K": 176 * 8 / 256, "Q6_K": 210 * 8 / 256}


@pytest.fixture(scope="module")
def exported(tiny_src, tmp_path_factory):  # noqa: F811
    from quantkit.gguf_job import quantize_to_gguf

    src, model = tiny_src
    out = tmp_path_factory.mktemp("gguf") / "tiny-q4_k_m.gguf"
    decoded: dict = {}
    quantize_to_gguf(str(src), str(out), "q4_k_m", method="rtn", decoded=decoded)
    return out, decoded


def test_inspect_reports_types_bits_and_bytes_as_ggml_defines_them(exported, tiny_src, cli):  # noqa: F811
    path, _ = exported
    _, model = tiny_src
    code, out, err = cli("inspect", path, "--json")
    assert code == 0, err
    info = json.loads(out)
    assert info["format"] == "gguf" and info["architecture"] == "llama" and info["file_type"] == "MOSTLY_Q4_K_M"
    for t in info["tensors"]:
        assert t["bits_per_weight"] == pytest.approx(SPEC_BITS[t["type"]]), t
        assert t["bytes"] * 8 == pytest.approx(t["parameters"] * SPEC_BITS[t["type"]]), t
    # every weight of the (tied) model is in the file once
    assert info["parameters"] == sum(p.numel() for p in model.parameters())
    assert info["tensor_bytes"] < info["file_bytes"] == path.stat().st_size
    kinds = {k["kind"]: k for k in info["kinds"]}
    assert kinds["attn_q.weight"]["count"] == model.config.num_hidden_layers
    assert set(kinds["ffn_down.weight"]["types"]) == {"Q4_K", "Q6_K"}  # the _M mix lifts some down projections
    code, table, err = cli("inspect", path)
    assert code == 0 and "attn_q.weight" in table and "Q6_K" in table, err
    code, rows, _ = cli("inspect", path, "--all")
    assert code == 0 and "blk.0.attn_q.weight" in rows


def test_inspect_refuses_a_file_that_is_not_gguf(tmp_path, cli):
    bad = tmp_path / "notes.gguf"
    bad.write_text("not a gguf file\n")
    code, _, err = cli("inspect", bad)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "not a readable GGUF file" in err, err


def test_eval_scores_a_gguf_file_as_its_dequantised_weights(exported, tiny_src, tmp_path, cli,  # noqa: F811
                                                            monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    path, decoded = exported
    src, model = tiny_src
    ours = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    ours.load_state_dict(decoded, strict=False)  # quantkit's decode of the very blocks in the file
    ours.save_pretrained(tmp_path / "decoded")
    text = tmp_path / "text.txt"
    text.write_text(" ".join(["Agnes took over the bakery on Mill Street in the autumn she turned thirty."] * 40))
    code, out, err = cli("eval", src, f"dec={tmp_path / 'decoded'}", f"q4={path}", "--data", text, "--seq-len",
                         "64", "--max-windows", "4", "--no-plots", "--json", "-q")
    assert code == 0, err
    report = json.loads(out)
    rows = {r["label"]: r for r in report["variants"]}
    assert rows["q4"]["ppl"] == pytest.approx(rows["dec"]["ppl"], rel=1e-5)
    assert abs(rows["q4"]["ppl"] / rows[report["base"]]["ppl"] - 1) > 1e-4  # the quantisation is visible
    assert rows["q4"]["quantized"] and rows["q4"]["quantization"].startswith("gguf MOSTLY_Q4_K_M")
    assert rows["q4"]["weight_bytes"] == path.stat().st_size
