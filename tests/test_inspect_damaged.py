"""Issue 37: `quantkit inspect` on damaged JSON files and headers is one line and exit 2, never a traceback or
an absurd report (2 TB and 48M bits per weight from a header whose shape disagreed with its offsets)."""
from __future__ import annotations

import json

import pytest
from damage import ckpt, damaged, run_cli  # noqa: F401  (fixtures)
from damage import edit_header_entry, one_line_error

Q = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("text, words", [
    ("", ["quantkit.json is empty"]),
    ('{"layers": {', ["quantkit.json is not valid JSON"]),
    ("[1, 2]", ["quantkit.json holds a JSON list, not an object"]),
    ('{"layers": [1]}', ["quantkit.json: layers is [1] (list); expected an object"]),
    (json.dumps({"layers": {Q: {"weight_rel_error": "0.1"}}}),
     [f"layers.{Q}.weight_rel_error is '0.1' (str); expected a number"]),
    (json.dumps({"layers": {Q: {"scheme": {"num_bits": 0}}}}), [f"layers.{Q}.scheme.num_bits is 0"]),
    (json.dumps({"source_bytes": "9"}), ["source_bytes is '9' (str); expected an integer"]),
    (json.dumps({"recipe": {"quant": []}}), ["recipe.quant is [] (list); expected an object"]),
    (json.dumps({"bit_budget": {"target": "4"}}), ["bit_budget.target is '4' (str)"]),
    ("[" * 100000, ["nested too deeply"]),
])
def test_damaged_quantkit_json(run_cli, damaged, text, words):
    (damaged / "quantkit.json").write_text(text)
    one_line_error(run_cli("inspect", damaged), *words, "re-run quantkit quantize")


def test_config_json_not_json(run_cli, damaged):
    (damaged / "config.json").write_text("{ not json")
    one_line_error(run_cli("inspect", damaged), "config.json is not valid JSON")


def test_config_json_symlink_to_a_binary_file(run_cli, damaged):
    (damaged / "config.json").unlink()
    (damaged / "config.json").symlink_to(damaged / "model.safetensors")
    one_line_error(run_cli("inspect", damaged), "config.json")


@pytest.mark.parametrize("cmd", ["inspect", "serve"])
def test_quantization_config_as_a_list(run_cli, damaged, cmd):
    cfg = json.loads((damaged / "config.json").read_text())
    cfg["quantization_config"] = [cfg["quantization_config"]]
    (damaged / "config.json").write_text(json.dumps(cfg))
    one_line_error(run_cli(cmd, damaged), "quantization_config is a list, not an object")


def test_shape_that_disagrees_with_its_offsets_is_no_absurd_size(run_cli, damaged):
    edit_header_entry(damaged, f"{Q}.weight_packed", lambda h: h.__setitem__("shape", [64, 100000000]))
    one_line_error(run_cli("inspect", damaged), f"{Q}.weight_packed", "needs 25600000000 bytes", "span 2048")


def test_codes_that_are_not_a_matrix(run_cli, damaged):
    edit_header_entry(damaged, f"{Q}.weight_packed", lambda h: h.__setitem__("shape", [512]))
    one_line_error(run_cli("inspect", damaged), f"{Q} codes have shape [512], not a matrix")
