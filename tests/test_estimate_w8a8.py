"""`quantkit estimate` on W8A8: int8 storage, and prefill bounded by the INT8 tensor-core peak."""
from __future__ import annotations

import json

from quantkit.evaluate.estimate import TENSOR_OPS, estimate

LLAMA_8B = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "intermediate_size": 14336, "vocab_size": 128256, "tie_word_embeddings": False}


def test_w8a8_stores_like_int8_and_prefills_at_the_int8_peak():
    r = estimate(LLAMA_8B, "h100", ["bf16", "int8", "w8a8", "fp8"])["precisions"]
    assert r["w8a8"]["weight_bytes"] == r["int8"]["weight_bytes"] < r["bf16"]["weight_bytes"]
    assert r["w8a8"]["prefill_compute"] == "int8" and r["int8"]["prefill_compute"] == "bf16"
    # 2 operations per Linear weight per token: 6.98e9 Linear weights in Llama-3-8B's decoder
    linear = 32 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096)
    assert abs(r["w8a8"]["prefill_tokens_per_s"] - 1979e12 / (2 * linear)) < 1
    assert r["w8a8"]["prefill_tokens_per_s"] / r["bf16"]["prefill_tokens_per_s"] == TENSOR_OPS["h100"]["int8"] / 989e12


def test_a100_has_int8_units_but_no_fp8():
    r = estimate(LLAMA_8B, "a100", ["bf16", "fp8", "w8a8"])["precisions"]
    assert r["fp8"]["prefill_compute"] == "bf16"
    assert r["fp8"]["prefill_tokens_per_s"] == r["bf16"]["prefill_tokens_per_s"]
    assert r["w8a8"]["prefill_tokens_per_s"] == 2 * r["bf16"]["prefill_tokens_per_s"]


def test_cli_prints_the_prefill_column(cli, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA_8B))
    code, out, _ = cli("estimate", cfg, "--gpu", "l40s", "--precision", "bf16,w8a8", "--json")
    assert code == 0
    rows = json.loads(out)["precisions"]
    assert rows["w8a8"]["prefill_compute"] == "int8"
    code, out, err = cli("estimate", cfg, "--gpu", "rtx4090", "--precision", "w8a8")
    assert code == 0 and "prefill" in out + err  # no datasheet peaks kept for this GPU: the column says '-'
    assert estimate(LLAMA_8B, "rtx4090", ["w8a8"])["precisions"]["w8a8"]["prefill_tokens_per_s"] is None
