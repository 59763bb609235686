"""Load a quantkit (or any compressed-tensors INT/FP8) checkpoint into its transformers model class.

The model is built with empty (meta) weights, every quantised Linear is swapped for the module that holds its
packed tensors (QuantLinear, FP8Linear: linear/dispatch.py), and the checkpoint tensors are assigned in place:
no float copy of the quantised weights is ever materialised. A folder without quantization_config loads as a
plain float model. Once loaded, linear/dispatch.py gives every Linear the layout it computes in.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from ..dtypes import parse_dtype
from ..errors import UserError
from ..formats.compressed_tensors import load_tensors, module_targets
from ..formats.integrity import check_layout, check_values
from ..formats.json_files import read_json_object
from ..formats.manifest import changed_since_written
from ..formats.moe_names import from_checkpoint, to_checkpoint
from ..formats.quant_config_check import check_group_fits, check_quantization_config
from ..formats.safetensors_header import read_header
from ..linear import dispatch
from ..models.moe import unfuse_experts

KV_SCALE_KEYS = (".k_scale", ".v_scale")


def attach_kv_scales(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Register each `<attention>.k_scale`/`.v_scale` tensor as a buffer of its attention module (where
    FP8KVCache.from_model finds them); returns the other tensors."""
    rest = {}
    for k, t in tensors.items():
        if not k.endswith(KV_SCALE_KEYS):
            rest[k] = t
            continue
        owner, _, attr = k.rpartition(".")
        try:
            mod = model.get_submodule(owner)
        except AttributeError:
            raise UserError(f"the checkpoint has {k} but the model has no module '{owner}'; re-run quantkit "
                            "quantize") from None
        if attr in mod._buffers:
            mod._buffers[attr] = t
        else:
            mod.register_buffer(attr, t)
    return rest


def read_config(path: Path) -> dict:
    """config.json of the checkpoint at PATH, its quantization_config checked: the first read of any folder, so a
    damaged config is named before a tokenizer or model reads it and fails in its own words."""
    if not (path / "config.json").is_file():
        raise UserError(f"'{path}' is not a model folder (no config.json); pass the folder quantkit quantize wrote")
    config = read_json_object(path / "config.json", "copy it again from the original folder or re-run quantkit "
                              "quantize")
    if config.get("quantization_config") is not None:
        check_quantization_config(path, config["quantization_config"])
    return config


def check_weight_files(path: Path, quantised: bool) -> None:
    """Every safetensors file the model will be read from is present and whole, checked from the headers
    before any loading, so a damaged copy is one clear error rather than a safetensors traceback."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        fix = "copy it again or re-run quantkit quantize"
        weight_map = read_json_object(index, fix).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) and "/" not in v for v in weight_map.values()):
            raise UserError(f"{index} is corrupt (weight_map is not a map of tensor names to file names); {fix}")
        names = sorted(set(weight_map.values()))
    elif (path / "model.safetensors").is_file() or quantised:
        names = ["model.safetensors"]
    else:
        return  # a float folder may hold .bin weights, which transformers reads and checks itself
    for name in names:
        read_header(path / name)


def warn_if_changed(path: Path) -> None:
    """One warning line when the files differ from quantkit.json's manifest: a user may have edited config.json
    on purpose, so it does not stop the load."""
    change = changed_since_written(path)
    if change:
        logging.getLogger("quantkit").warning(f"warning: '{path}' is not as quantkit wrote it ({change}); if that "
                                              f"was not on purpose, run quantkit verify {path}")


def read_model(path: str | Path, device: str = "cpu", dtype: torch.dtype | str | None = None,
               cpu_fast: bool = False, relayout: bool = False, check_manifest: bool = True) -> nn.Module:
    """The mechanism under quantkit.load (runtime/checkpoint.py), which chooses these options; only verify
    calls it directly (it checks the manifest itself).
    cpu_fast: on CPU, run quantised layers through torch's packed int4/int8 ops with bf16 activations
    whatever the model dtype, and a float32 output head as a float16 copy (linear/half_head.py): the runtime's
    choice, much faster, ~1e-3 relative difference in logits. The default keeps the model's dtype exactly
    (dequantise + matmul).
    relayout: the runtime's own model, which only decodes: a float model's CPU weights are re-laid out for
    speed (linear/relayout.py), and the decode step's fused projections (linear/fused.py) are built now, before
    any forward, and kept on the model (llama_step.attach_plan).
    check_manifest: warn when the files differ from quantkit.json's manifest (`quantkit verify` checks it
    itself, in full)."""
    path = Path(path)
    qc = read_config(path).get("quantization_config")
    dtype = parse_dtype(dtype)
    check_weight_files(path, quantised=qc is not None)
    if qc is None:
        model = _load_float(path, device, dtype)
    else:
        model = _load_quantised(path, qc, device, dtype)
    model.eval()
    if check_manifest:
        warn_if_changed(path)  # after the checks: a damaged checkpoint gets its one error line, not two
    dispatch.apply(model, cpu_fast=cpu_fast, relayout=relayout)
    if relayout:
        from . import llama_step

        setattr(model, llama_step.RELAYOUT_ATTR, True)
        if llama_step.supports(model):
            llama_step.attach_plan(model)
    return model


def _load_float(path: Path, device: str, dtype: torch.dtype | None) -> nn.Module:
    """A float folder through transformers, its shapes checked against config.json first and its values after."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..models.hf import meta_model
    from ..models.shape_check import check_weights_match

    try:
        check_weights_match(path, meta_model(AutoConfig.from_pretrained(path), dtype or torch.float32))
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or "auto").to(device)
    except UserError:
        raise
    # transformers raises many types for a config or weights it cannot use (ValueError, TypeError, its
    # strict-dataclass errors, RuntimeError for a size mismatch); each means the folder is unusable
    except Exception as e:  # noqa: BLE001
        detail = " ".join(str(e).split())[:200]
        raise UserError(f"cannot load the model in '{path}' ({type(e).__name__}: {detail}); copy it again or "
                        "re-save it with save_pretrained") from None
    check_values(path, model.state_dict())
    return model


def _unbuildable(path: Path, e: Exception) -> UserError:
    detail = " ".join(str(e).split())[:200]
    return UserError(f"{path / 'config.json'} does not describe a model transformers can build "
                     f"({type(e).__name__}: {detail}); restore it from the checkpoint quantkit wrote, or re-run "
                     "quantkit quantize")


def _build_empty(path: Path, config, dtype: torch.dtype) -> nn.Module:
    """The model config.json describes, with meta weights; a config transformers cannot build is one line."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    try:
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except Exception as e:  # noqa: BLE001  (as in load: model classes check their config in many ways)
        raise _unbuildable(path, e) from None
    unfuse_experts(model)  # per-expert Linears, as the checkpoint stores them
    return model


def _swap_quantised(path: Path, model: nn.Module, qc: dict, tensors: dict, dtype: torch.dtype) -> dict[str, str]:
    """Each Linear quantization_config covers becomes the empty module its tensors load into; returns
    {module name: what config.json says of its layout}, for the layout check's messages."""
    mt = getattr(model.config, "model_type", None)
    linears = {to_checkpoint(mt, n): (n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    targeted = module_targets(qc, {k: m for k, (_, m) in linears.items()})
    groups = {id(v): k for k, v in qc["config_groups"].items()}
    implied = {}
    for key, group in targeted.items():
        name, linear = linears[key]
        w = group["weights"]
        check_group_fits(path, name, w, linear.in_features)
        model.set_submodule(name, dispatch.stored(linear, group, has_g_idx=f"{name}.weight_g_idx" in tensors,
                                                  has_input_scale=f"{name}.input_scale" in tensors, dtype=dtype))
        size = f", group size {w.get('group_size')}" if w.get("strategy") in ("group", "tensor_group") else ""
        implied[name] = (f"quantization_config {groups.get(id(group), 'group')}: {w['num_bits']}-bit {w['type']} "
                         f"{w['strategy']}{size}")
    return implied


def _load_quantised(path: Path, qc: dict, device: str, dtype: torch.dtype | None) -> nn.Module:
    """The model with every quantised Linear as the module dispatch.stored gives, loaded and on `device`."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001  (as in load: any failure here means config.json is unusable)
        raise _unbuildable(path, e) from None
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    tensors = load_tensors(path)
    check_values(path, tensors)
    if dtype is None:
        dtype = next((t.dtype for k, t in tensors.items() if k.endswith("weight_scale") or k.endswith("norm.weight")),
                     torch.float16)
    model = _build_empty(path, config, dtype)
    mt = getattr(config, "model_type", None)
    tensors = {from_checkpoint(mt, k): t for k, t in tensors.items()}
    implied = _swap_quantised(path, model, qc, tensors, dtype)
    # KV scales stay float32, taken before the cast below, so FP8KVCache sees exactly the stored values
    kv_scales = {k: tensors.pop(k).float() for k in [k for k in tensors if k.endswith(KV_SCALE_KEYS)]}
    check_layout(path, tensors, model.state_dict(keep_vars=True), implied)
    # assign=True keeps the stored dtype, so float tensors are cast here to the dtype the caller asked for
    tensors = {k: t.to(dtype) if t.is_floating_point() and t.element_size() > 1 else t for k, t in tensors.items()}
    attach_kv_scales(model, kv_scales)
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
        missing = [k for k in missing if k != "lm_head.weight"]
    leftover = [k for k in missing if not k.endswith("weight_g_idx") and k not in kv_scales]
    meta_params = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if leftover or unexpected or meta_params:
        raise UserError(f"'{path}' does not match its config: missing {leftover[:3]}, unexpected {unexpected[:3]}, "
                        f"uninitialised {meta_params[:3]}; re-run quantkit quantize")
    return model.to(device)
