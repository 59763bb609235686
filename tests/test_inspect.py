"""`quantkit inspect`: bits per weight including scales, errors, and sizes, as a table and as JSON."""
import json

from helpers import make_tiny_model
from test_data_support import SAMPLE, tiny_tokenizer

from quantkit.inspect_ckpt import solver_summary


def test_inspect_json_and_table(tmp_path, cli):
    src = make_tiny_model(tmp_path / "src", "llama")
    assert cli("quantize", "--method", "rtn", src, "-o", tmp_path / "w4", "--quiet", "--group-size", "64")[0] == 0
    assert cli("quantize", "--method", "rtn", src, "-o", tmp_path / "w8", "--quiet", "--scheme", "w8a16", "--set", "quant.symmetric=false")[0] == 0
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
    assert code == 0 and "bits/w" in out and "smaller" in out


def test_inspect_bad_folder(tmp_path, cli):
    code, _, err = cli("inspect", tmp_path)
    assert code == 2 and "no config.json" in err


def test_inspect_shows_what_each_method_did(tmp_path, cli, monkeypatch):
    """Issue 23.5: per layer, quantkit.json's record of the solver (AWQ's alpha and clip, GPTQ's order and guard,
    learned rounding's steps) is in inspect's JSON and summarised in its table."""
    src = make_tiny_model(tmp_path / "src", "llama")
    tiny_tokenizer().save_pretrained(src)
    calib = ["--calib", SAMPLE, "--num-samples", "5", "--seq-len", "32", "--group-size", "32", "-q"]
    runs = {"gptq": [], "awq": ["--set", "quant.awq.grid=4"], "signround": ["--set", "quant.signround.iters=2"]}
    for method, extra in runs.items():
        assert cli("quantize", src, "-o", tmp_path / method, "--method", method, *calib, *extra)[0] == 0
    rows = {m: json.loads(cli("inspect", tmp_path / m, "--json")[1])["layers"] for m in runs}
    gptq = rows["gptq"][0]["solver"]
    assert set(gptq["held_out_error"]) == {"act-order weight",
                                                                                    "act-order off", "rtn"}
    awq = {r["layer"]: r["solver"] for r in rows["awq"]}
    assert all("awq_clip_mean" in s for n, s in awq.items() if not n.endswith(("q_proj", "k_proj")))
    assert any(s.get("awq_alpha") is not None for s in awq.values())
    assert all(r["solver"]["signround_iters"] == 2 for r in rows["signround"])
    assert solver_summary(rows["signround"][0]["solver"]).startswith("signround 2 steps")
    assert all(r["solver"]["grid"] == "full range" for m in runs for r in rows[m])  # the default 4-bit grid
    assert "awq a=" in " ".join(solver_summary(s) for s in awq.values())
    monkeypatch.setenv("COLUMNS", "200")  # a wide terminal: the summaries print whole
    code, out, _ = cli("inspect", tmp_path / "gptq", "--all")
    assert code == 0 and "solver" in out and ("gptq act-order" in out or "guard chose" in out)
    assert "full-range grid on" in out
    # the plain grid leaves no such mark
    assert cli("quantize", src, "-o", tmp_path / "plain", "--method", "rtn", "--set", "quant.full_range=false", "-q")[0] == 0
    plain = json.loads(cli("inspect", tmp_path / "plain", "--json")[1])["layers"]
    assert all("grid" not in r["solver"] for r in plain)


def test_inspect_fits_80_columns_and_never_cuts_a_name(tmp_path, cli, monkeypatch):
    """Issue 38.8: by default one row per layer type (q_proj x 12, error min/median/max), every Linear with
    --all, both within 80 columns with every name whole; a narrower terminal moves figures under the name."""
    src = make_tiny_model(tmp_path / "src", "llama", layers=12)  # two-digit block indices, like a real model
    tiny_tokenizer().save_pretrained(src)
    calib = ["--calib", SAMPLE, "--num-samples", "4", "--seq-len", "32", "--group-size", "32", "-q"]
    assert cli("quantize", src, "-o", tmp_path / "q", "--method", "awq", "--set", "quant.awq.grid=4", *calib)[0] == 0
    info = json.loads(cli("inspect", tmp_path / "q", "--json")[1])
    assert len(info["layers"]) == 84 and all("weight_rel_error" in r and "solver" in r for r in info["layers"])
    types = {t["type"]: t for t in info["layer_types"]}
    assert set(types) == {f"self_attn.{p}_proj" for p in "qkvo"} | {f"mlp.{p}_proj" for p in ("gate", "up", "down")}
    q_errors = sorted(r["weight_rel_error"] for r in info["layers"] if r["layer"].endswith("q_proj"))
    assert types["self_attn.q_proj"]["count"] == 12 and types["self_attn.q_proj"]["scheme"] == "w4a16"
    assert types["self_attn.q_proj"]["weight_rel_error"] == {
        "min": q_errors[0], "median": (q_errors[5] + q_errors[6]) / 2, "max": q_errors[-1]}
    monkeypatch.setenv("COLUMNS", "80")
    code, summary, _ = cli("inspect", tmp_path / "q")
    code_all, every, _ = cli("inspect", tmp_path / "q", "--all")
    assert code == code_all == 0
    for out in (summary, every):
        assert max(map(len, out.splitlines())) <= 80 and "\u2026" not in out and "..." not in out
    assert len(summary.splitlines()) < 20 and "x12" in summary
    assert all(f"{kind} " in summary for kind in types)
    assert all(f"{r['layer']} " in every for r in info["layers"]) and "awq a=" in every
    monkeypatch.setenv("COLUMNS", "30")  # narrower than a name: the name stands alone, whole
    out = cli("inspect", tmp_path / "q", "--all")[1]
    names = {r["layer"] for r in info["layers"]}
    assert names <= set(out.splitlines())
    assert all(len(line) <= 30 for line in out.splitlines() if line not in names)
