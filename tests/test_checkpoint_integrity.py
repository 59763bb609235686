"""Issue 37.1: a damaged checkpoint is refused before the first forward, in one line naming the tensor (or the
config field), what was expected and what was found; exit 2 from generate and serve, a UserError from
quantkit.load. Each test is one of the issue's reproduced defects."""
from __future__ import annotations

import shutil

import pytest
import torch
from damage import ckpt, damaged, run_cli  # noqa: F401  (fixtures)
from damage import edit_header_entry, edit_json, edit_tensors, one_line_error, read_raw, write_raw

import quantkit
from quantkit.errors import UserError

Q = "model.layers.0.self_attn.q_proj"


def _args(cmd, folder):
    return [cmd, folder, "--prompt", "hi", "--max-tokens", "3"] if cmd == "generate" else [cmd, folder]


def _set(name, value, where=(0, 0)):
    def edit(tensors):
        tensors[name][where] = value
    return edit


@pytest.mark.parametrize("cmd", ["generate", "serve"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_scale_is_refused(run_cli, damaged, cmd, value):
    """One NaN or +Inf in a weight_scale: generate printed an empty completion, serve answered 200 with ''."""
    edit_tensors(damaged, _set(f"{Q}.weight_scale", value))
    one_line_error(run_cli(*_args(cmd, damaged)), f"{Q}.weight_scale", "1 non-finite", str(value), "[0, 0]")


def test_all_zero_scales_are_refused(run_cli, damaged):
    """All-zero scales: generate exited 0 with ' is is is is'."""
    edit_tensors(damaged, lambda t: t[f"{Q}.weight_scale"].zero_())
    one_line_error(run_cli(*_args("generate", damaged)), f"{Q}.weight_scale", "64 zero scale(s)")


def test_non_finite_float_weight_is_refused(damaged):
    edit_tensors(damaged, _set("model.embed_tokens.weight", float("-inf"), (5, 1)))
    with pytest.raises(UserError, match=r"model.embed_tokens.weight holds 1 non-finite value\(s\) \(first -inf at \[5, 1\]"):
        quantkit.load(damaged)


@pytest.mark.parametrize("field, value, words", [
    ("group_size", 32, ["weight_scale is float32 [64, 1]", "group size 32", "implies float [64, 2]"]),
    ("group_size", 128, ["group_size 128 does not divide", "64 inputs"]),
    ("group_size", 48, ["group_size 48 does not divide"]),
    ("group_size", "64", ["weights.group_size is '64' (str)", "a positive integer"]),
    ("num_bits", 8, ["weight_packed is int32 [64, 8]", "8-bit int", "implies int32 [64, 16]"]),
    ("num_bits", 3, ["weight_packed is int32 [64, 8]", "3-bit int", "implies int32 [64, 6]"]),
    ("num_bits", 5, ["weights.num_bits is 5 (int)", "one of 2, 3, 4, 8"]),
    ("strategy", "row", ["weights.strategy is 'row'"]),
])
def test_edited_quantization_config_is_refused(run_cli, damaged, field, value, words):
    """config.json's group size or bits edited: tracebacks from the module constructors or load_state_dict."""
    edit_json(damaged, "config.json",
              lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].__setitem__(field, value))
    one_line_error(run_cli(*_args("generate", damaged)), "config.json", *words)


def test_quantization_config_as_a_list_is_refused(damaged):
    edit_json(damaged, "config.json", lambda c: c.__setitem__("quantization_config", [1, 2]))
    with pytest.raises(UserError, match="quantization_config is a list, not an object"):
        quantkit.load(damaged)


@pytest.mark.parametrize("suffix", ["weight_packed", "weight_scale"])
def test_tensor_one_column_short_is_refused(run_cli, damaged, suffix):
    name = f"model.layers.1.mlp.down_proj.{suffix}"

    def cut(tensors):
        tensors[name] = tensors[name][:, :-1].contiguous()
    edit_tensors(damaged, cut)
    want = {"weight_packed": "int32 [64, 16]", "weight_scale": "float [64, 2]"}[suffix]
    one_line_error(run_cli(*_args("serve", damaged)), name, f"implies {want}", "quantization_config group_0")


def test_packed_weights_stored_as_float_are_refused(damaged):
    edit_tensors(damaged, lambda t: t.__setitem__(f"{Q}.weight_packed", t[f"{Q}.weight_packed"].float()))
    with pytest.raises(UserError, match=rf"{Q}.weight_packed is float32 \[64, 8\] .* implies int32 \[64, 8\]"):
        quantkit.load(damaged)


def test_cut_embedding_is_refused(damaged):
    edit_tensors(damaged, lambda t: t.__setitem__("model.embed_tokens.weight", t["model.embed_tokens.weight"][:1000]))
    with pytest.raises(UserError, match=r"model.embed_tokens.weight is float32 \[1000, 64\] .*its architecture\) "
                                        r"implies float \[49152, 64\]"):
        quantkit.load(damaged)


def test_weight_shape_record_must_match(damaged):
    edit_tensors(damaged, lambda t: t.__setitem__(f"{Q}.weight_shape", torch.tensor([64, 32], dtype=torch.int32)))
    with pytest.raises(UserError, match=rf"{Q}.weight_shape records shape \[64, 32\] but the model's Linear is \[64, 64\]"):
        quantkit.load(damaged)


@pytest.mark.parametrize("edit, words", [
    (lambda h: h["data_offsets"].__setitem__(0, h["data_offsets"][0] - 4), ["needs 256 bytes", "span 260"]),
    (lambda h: h.__setitem__("shape", [-64, 1]), ["shape [-64, 1]", "non-negative integers"]),
    (lambda h: h.__setitem__("dtype", "F7"), ["unknown dtype 'F7'"]),
    (lambda h: h.__setitem__("shape", [32, 1]), ["is F32 [32, 1], which needs 128 bytes", "span 256"]),
])
def test_malformed_header_entry_is_refused(run_cli, damaged, edit, words):
    edit_header_entry(damaged, f"{Q}.weight_scale", edit)
    one_line_error(run_cli(*_args("generate", damaged)), "corrupt safetensors header", f"{Q}.weight_scale", *words)


def test_overlapping_offsets_are_refused(run_cli, damaged):
    """Two tensors over the same bytes, each consistent with its shape: the header check compared only the
    last tensor's end with the file size."""
    head, data = read_raw(damaged)
    a, b = f"{Q}.weight_scale", "model.layers.0.self_attn.o_proj.weight_scale"  # both F32 [64, 1]
    head[a]["data_offsets"] = list(head[b]["data_offsets"])
    write_raw(damaged, head, data)
    for cmd in ("generate", "inspect"):
        one_line_error(run_cli(*_args(cmd, damaged)), "overlap")


@pytest.fixture
def float_copy(ckpt, tmp_path):
    """A copy of the float model the checkpoint was quantised from (a folder the runtime also serves)."""
    shutil.copytree(ckpt.parent / "src", tmp_path / "float")
    return tmp_path / "float"


def test_float_model_with_a_cut_embedding_is_refused(run_cli, float_copy):
    """A float folder goes through transformers, whose size mismatch was a traceback pointing at a report."""
    edit_tensors(float_copy, lambda t: t.__setitem__("model.embed_tokens.weight", t["model.embed_tokens.weight"][:1000]))
    one_line_error(run_cli(*_args("generate", float_copy)), "model.embed_tokens.weight is [1000, 64]", "[49152, 64]")


def test_float_model_with_a_nan_weight_is_refused(float_copy):
    edit_tensors(float_copy, _set("model.norm.weight", float("nan"), (3,)))
    with pytest.raises(UserError, match=r"model.norm.weight holds 1 non-finite value\(s\) \(first nan at \[3\]\)"):
        quantkit.load(float_copy)
