"""`quantkit estimate` against values worked out by hand for Llama-3-70B and Llama-3-8B configs."""
import json
from pathlib import Path

import pytest

import quantkit.cli.estimate_cmd  # noqa: F401  (registers the command until the lead wires it into _register)
from quantkit.errors import UserError
from quantkit.evaluate.estimate import estimate, load_config, param_counts, shape_from_config

DATA = Path(__file__).resolve().parent / "data"
C70, C8 = DATA / "llama3_70b_config.json", DATA / "llama3_8b_config.json"

# Hand arithmetic, 70B (hidden 8192, 80 layers, 64 heads, 8 KV heads, head dim 128, MLP 28672, vocab 128256):
#   attention per layer: q 8192*8192 + k,v 2*8192*1024 + o 8192*8192 = 150,994,944
#   MLP per layer: 3*8192*28672 = 704,643,072; Linears: 80 * 855,638,016 = 68,451,041,280
#   other: embeddings + untied lm_head 2*128256*8192 = 2,101,346,304, norms 80*2*8192 + 8192 = 1,318,912
P70_LINEAR, P70_OTHER = 68_451_041_280, 2_102_665_216
# 8B (hidden 4096, 32 layers, 32 heads, 8 KV heads, MLP 14336): attention 41,943,040 + MLP 176,160,768 per
# layer, times 32 = 6,979,321,856; other 2*128256*4096 + 32*2*4096 + 4096 = 1,050,939,392
P8_LINEAR, P8_OTHER = 6_979_321_856, 1_050_939_392


def test_parameter_counts_match_the_published_sizes():
    assert param_counts(shape_from_config(load_config(str(C70)))) == {
        "linear": P70_LINEAR, "other": P70_OTHER, "total": 70_553_706_496}  # "70.6B"
    assert param_counts(shape_from_config(load_config(str(C8))))["total"] == P8_LINEAR + P8_OTHER == 8_030_261_248


def test_70b_on_h100_by_hand():
    r = estimate(load_config(str(C70)), "h100", ["bf16", "fp8", "int4"], context=8192, batch=1)["precisions"]
    bf16 = 2 * (P70_LINEAR + P70_OTHER)
    # fp8: 1 byte per Linear weight + a 2-byte scale per output channel (80 layers x 83,968 outputs)
    fp8 = P70_LINEAR + 80 * 83_968 * 2 + 2 * P70_OTHER
    # int4: half a byte per weight + a 2-byte scale per group of 128
    int4 = P70_LINEAR // 2 + P70_LINEAR // 128 * 2 + 2 * P70_OTHER
    assert [r[p]["weight_bytes"] for p in ("bf16", "fp8", "int4")] == [bf16, fp8, int4]
    assert bf16 == 141_107_412_992 and fp8 == 72_669_806_592 and int4 == 39_500_398_592
    kv = 2 * 80 * 8 * 128 * 2  # K and V, layers, KV heads, head dim, bf16
    assert all(r[p]["kv_bytes_per_token"] == kv == 327_680 for p in r)
    # usable memory per H100: 0.9 * 80e9 = 72e9 bytes
    assert [r[p]["gpus"] for p in ("bf16", "fp8", "int4")] == [2, 2, 1]
    for p in r:
        read = r[p]["weight_bytes"] + 8192 * kv
        assert r[p]["tokens_per_s"] == pytest.approx(r[p]["gpus"] * 3.35e12 / read, rel=1e-12)
    assert r["bf16"]["tokens_per_s"] == pytest.approx(46.60, abs=0.01)  # 2 * 3.35e12 / 143.79e9


def test_8b_on_l4_by_hand():
    r = estimate(load_config(str(C8)), "l4", ["bf16", "int4"], context=4096, batch=4, kv_dtype="fp8")
    p = r["precisions"]
    kv = 2 * 32 * 8 * 128 * 1  # fp8 KV: one byte per value
    assert p["bf16"]["kv_bytes_per_token"] == kv == 65_536
    assert p["bf16"]["weight_bytes"] == 16_060_522_496
    # bf16: 16.06e9 weights + 4 * 4096 * 65,536 KV = 17.13e9 bytes over 0.9 * 24e9 = 21.6e9 usable: one L4
    assert p["bf16"]["gpus"] == 1
    assert p["bf16"]["tokens_per_s"] == pytest.approx(0.3e12 / (16_060_522_496 + 4 * 4096 * 65_536), rel=1e-12)
    assert p["int4"]["weight_bytes"] == P8_LINEAR // 2 + P8_LINEAR // 128 * 2 + 2 * P8_OTHER


def test_mixture_of_experts_reads_only_active_experts():
    cfg = dict(json.loads(C8.read_text()), num_local_experts=8, num_experts_per_tok=2)
    dense = estimate(json.loads(C8.read_text()), "h100", ["bf16"])["precisions"]["bf16"]
    moe = estimate(cfg, "h100", ["bf16"])["precisions"]["bf16"]
    mlp = 32 * 3 * 4096 * 14336 * 2  # one expert's MLP bytes over all layers
    router = 32 * 4096 * 8 * 2
    assert moe["weight_bytes"] == dense["weight_bytes"] + 7 * mlp + router
    read = moe["weight_bytes"] - 6 * mlp + moe["kv_bytes"]
    assert moe["tokens_per_s"] == pytest.approx(moe["gpus"] * 3.35e12 / read, rel=1e-12)


def test_bad_input():
    cfg = load_config(str(C8))
    with pytest.raises(UserError, match="unknown GPU 'v100'; known: h100"):
        estimate(cfg, "v100", ["bf16"])
    with pytest.raises(UserError, match="unknown precision int3"):
        estimate(cfg, "h100", ["int3"])
    with pytest.raises(UserError, match="lacks hidden_size"):
        estimate({"vocab_size": 3}, "h100", ["bf16"])
    with pytest.raises(UserError, match="neither a file"):
        load_config("no-such-org/no-such-model")


def test_cli_json_and_table(cli, tmp_path):
    code, out, err = cli("estimate", C70, "--gpu", "h200", "--precision", "bf16,int4", "--context", "8192", "--json")
    assert code == 0, err
    r = json.loads(out)
    assert set(r["precisions"]) == {"bf16", "int4"}
    assert {"weight_bytes", "kv_bytes_per_token", "gpus", "tokens_per_s"} <= set(r["precisions"]["int4"])
    assert r["precisions"]["bf16"]["gpus"] == 2  # 143.8e9 bytes over 0.9 * 141e9 usable
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(C8.read_text())
    code, out, err = cli("estimate", folder, "--gpu", "a100")
    assert code == 0 and "tokens/s" in err and "int4" in err
    code, _, err = cli("estimate", C8, "--gpu", "tpu")
    assert code == 2 and "unknown GPU" in err


def test_cli_quantise_time_and_memory_per_rank_count(cli):
    """--ranks shares the calibration tokens and the solves; --json keeps every figure; a GPU has no measured
    time constants, so it gets memory alone."""
    runs = {}
    for ranks, nodes in ((1, 1), (8, 1), (16, 2)):
        code, out, err = cli("estimate", C8, "--ranks", str(ranks), "--nodes", str(nodes), "--num-samples", "64",
                             "--json")
        assert code == 0, err
        runs[ranks] = json.loads(out)["quantize"]
    one, eight = runs[1], runs[8]
    assert eight["memory"]["activations"] == one["memory"]["activations"] / 8  # 64 samples: 8 per rank
    assert eight["memory"]["hessians"] == one["memory"]["hessians"]  # pooled: every rank holds them whole
    if one["seconds"] is not None:
        assert eight["per_layer"]["calibration"] == pytest.approx(one["per_layer"]["calibration"] / 8)
        assert runs[16]["link"] == "ib100"
    code, out, err = cli("estimate", C8, "--device", "h100", "--ranks", "8", "--json")
    assert code == 0 and json.loads(out)["quantize"]["seconds"] is None
    code, _, err = cli("estimate", C8, "--ranks", "8")
    assert code == 0 and "quantise (gptq" in err and "peak memory per rank" in err
    code, out, err = cli("estimate", C8, "--num-samples", "64", "--max-memory", "cpu=1GiB", "--json")
    capped = json.loads(out)["quantize"]["memory"]
    assert code == 0 and capped["activations_on_disk"] == one["memory"]["activations"]
    assert capped["activations"] == one["memory"]["activations"] / 64  # one sample of each set in memory
    code, _, err = cli("estimate", C8, "--num-samples", "64", "--max-memory", "cpu=1GiB")
    assert code == 0 and "activations on disk" in err
    for bad, msg in ((["--ranks", "3", "--nodes", "2"], "share evenly"), (["--device", "tpu"], "unknown device"),
                     (["--max-memory", "64G"], "--max-memory: '64G' is not a size"),
                     (["--method", "awq"], "modelled for --method"), (["--ranks", "200"], "cannot be shared")):
        code, _, err = cli("estimate", C8, *bad)
        assert code == 2 and msg in err, err
