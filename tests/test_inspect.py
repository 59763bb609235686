"""`quantkit inspect`: bits per weight including scales, errors, and sizes, as a table and as JSON."""
import json

from helpers import make_tiny_model


def test_inspect_json_and_table(tmp_path, cli):
    src = make_tiny_model(tmp_path / "src", "llama")
    assert cli("quantize", src, "-o", tmp_path / "w4", "--quiet", "--group-size", "64")[0] == 0
    assert cli("quantize", src, "-o", tmp_path / "w8", "--quiet", "--scheme", "w8a16", "--asym")[0] == 0
    code, out, _ = cli("inspect", tmp_path / "w4", "--json")
    assert code == 0
    info = json.loads(out)
    assert len(info["layers"]) == 14
    # 4-bit codes + one float32 scale (the tiny model's dtype) per 64 weights = 4 + 32/64 bits
    assert {r["bits_per_weight"] for r in info["layers"]} == {4.5}
    assert all(0 < r["weight_rel_error"] < 0.3 for r in info["layers"])
    assert info["source_bytes"] > info["total_bytes"] > 0
    down = next(r for r in json.loads(cli("inspect", tmp_path / "w8", "--json")[1])["layers"]
                if r["layer"].endswith("down_proj"))
    # 8-bit codes + a float32 scale and an 8-bit zero point per row of 256 inputs
    assert down["bits_per_weight"] == round(8 + (32 + 8) / 256, 3)
    assert down["shape"] == [128, 256]
    code, out, _ = cli("inspect", tmp_path / "w4")
    assert code == 0 and "bits/weight" in out and "smaller" in out


def test_inspect_bad_folder(tmp_path, cli):
    code, _, err = cli("inspect", tmp_path)
    assert code == 2 and "no config.json" in err
