"""Lazy loading: the model skeleton on the meta device, decoder layers read from safetensors one at a time.

Only what lives outside the decoder layers (embeddings, final norm, head) is read up front. The pipeline calls
`load_layer(i)` right before it processes decoder layer i and `release(names)` right after, which turns the
float weights of the layer's quantised Linears back into meta tensors (their codes are kept as QWeights). Small
tensors such as norms and biases stay, because AWQ folds its scales into them and the writer saves them.
Peak memory is therefore about one layer plus the calibration activations, the head, and the codes.

Mixture-of-experts layers stream too: the skeleton's fused experts are split into one meta Linear per expert
projection up front (models/moe.py), so the plan sees every expert, and each expert weight is read from the
checkpoint's per-expert key (Mixtral's `block_sparse_moe.experts.{e}.w1`, formats/moe_names.py) or, when the
checkpoint stores the experts fused, as its rows of the fused tensor.

`open_lazy` returns None whenever the checkpoint cannot be mapped onto the model one key per state-dict entry
(not safetensors, renamed keys that transformers converts on load); the caller then loads the whole model the
ordinary way. A shape that does not match config.json is an error (shape_check.py), not a fallback.
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

from .. import heap
from ..errors import UserError
from ..formats.moe_names import from_checkpoint
from .hf import (check_linear_projections, decoder_layers, load_error, load_tokenizer, meta_model, read_config,
                 resolve_dtype, resolve_model_dir)
from .moe import fused_sources, unfuse_experts
from .shape_check import check_weights_match, safetensors_shapes

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def checkpoint_files(src: Path) -> dict[str, Path] | None:
    """{tensor key: safetensors file} for a single-file or sharded checkpoint; None when there is neither."""
    from safetensors import safe_open

    if (src / INDEX).is_file():
        try:
            weight_map = json.loads((src / INDEX).read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise load_error(src, e) from None
        return {k: src / f for k, f in weight_map.items()}
    if (src / SINGLE).is_file():
        try:
            with safe_open(src / SINGLE, framework="pt") as f:
                return dict.fromkeys(f.keys(), src / SINGLE)
        except Exception as e:
            raise load_error(src, e) from None
    return None


class LazyWeights:
    """Reads state-dict entries of a meta-initialised model from its safetensors files on demand."""

    def __init__(self, model: nn.Module, files: dict[str, Path], sources: dict[str, str]):
        self.model = model
        self.files = files
        self.sources = sources  # state-dict key -> checkpoint key (the same name; tied aliases share one)
        self.slices: dict[str, tuple] = {}  # state-dict key -> its index into a fused checkpoint tensor
        self.layers_name, self.layers = decoder_layers(model)
        # every (module, attribute) a tensor is reachable under, so tied weights stay one Parameter
        self.slots: dict[str, list[tuple[nn.Module, str]]] = {}
        self.aliases: dict[str, list[str]] = {}
        by_tensor = defaultdict(list)
        for name, mod in model.named_modules(remove_duplicate=False):
            for leaf, t in list(mod._parameters.items()) + list(mod._buffers.items()):
                if t is not None:
                    by_tensor[id(t)].append((f"{name}.{leaf}" if name else leaf, mod, leaf))
        for group in by_tensor.values():
            for key, _, _ in group:
                self.slots[key] = [(m, leaf) for _, m, leaf in group]
                self.aliases[key] = [k for k, _, _ in group]

    def _set(self, key: str, value: torch.Tensor) -> None:
        mod, leaf = self.slots[key][0]
        old = mod._parameters.get(leaf) if leaf in mod._parameters else mod._buffers.get(leaf)
        # a copy: safetensors hands out views of a whole-file mapping, and one kept view (a norm) would pin every
        # page of the layer that was read through it
        value = value.to(old.dtype, copy=True)
        new = nn.Parameter(value, requires_grad=old.requires_grad) if isinstance(old, nn.Parameter) else value
        for m, lf in self.slots[key]:
            if lf in m._parameters:
                m._parameters[lf] = new
            else:
                m._buffers[lf] = new

    def materialise(self, keys: list[str]) -> None:
        """Read KEYS from disk, one file open per shard; the mapping is closed again so its pages leave RSS."""
        from safetensors import safe_open

        by_file, done = defaultdict(list), set()
        for k in keys:
            if k not in done:  # tied aliases share one read
                done.update(self.aliases[k])
                by_file[self.files[self.sources[k]]].append(k)
        for path, ks in by_file.items():
            try:
                with safe_open(path, framework="pt") as f:
                    for k in ks:
                        index = self.slices.get(k)
                        self._set(k, f.get_tensor(self.sources[k]) if index is None
                                  else f.get_slice(self.sources[k])[index])
            except Exception as e:
                raise load_error(path.parent, e) from None

    def layer_keys(self, i: int) -> list[str]:
        prefix = f"{self.layers_name}.{i}."
        return [k for k in self.sources if k.startswith(prefix)]

    def load_layer(self, i: int) -> None:
        self.materialise(self.layer_keys(i))

    def release(self, linear_names) -> None:
        """Drop the float weights of these (quantised) Linears; their codes live on in the pipeline's QWeights."""
        for name in linear_names:
            self._to_meta(f"{name}.weight")
        heap.trim()

    def unload_layer(self, i: int) -> None:
        """Every tensor layer I read back on meta, as before load_layer (models/streamed_forward.py)."""
        for key in self.layer_keys(i):
            self._to_meta(key)
        heap.trim()

    def _to_meta(self, key: str) -> None:
        """KEY's tensor replaced by a meta one of its shape, one object under every name it has (tied stay tied)."""
        mod, leaf = self.slots[key][0]
        t = mod._parameters[leaf] if leaf in mod._parameters else mod._buffers[leaf]
        meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
        if isinstance(t, nn.Parameter):
            meta = nn.Parameter(meta, requires_grad=False)
        for m, lf in self.slots[key]:
            (m._parameters if lf in m._parameters else m._buffers)[lf] = meta


def meta_tensors(model: nn.Module) -> list[str]:
    return [k for k, v in model.state_dict().items() if v.is_meta]


def _source_keys(model: nn.Module, ckpt_keys, aliases: dict[str, list[str]], model_type: str | None):
    """({state-dict key: checkpoint key}, {state-dict key: index into a fused tensor}), or None when the names do
    not line up one to one. Checkpoint keys are read in the module tree's names (Mixtral's block_sparse_moe is
    mlp there); an expert Linear the checkpoint does not store on its own is read from its fused tensor."""
    named = {from_checkpoint(model_type, k): k for k in ckpt_keys}
    fused = fused_sources(model)
    if not set(named) - {f for f, _ in fused.values()} <= set(aliases):
        return None  # a key the model lacks: transformers would rename or convert it on load
    sources, slices = {}, {}
    for key, t in model.state_dict().items():
        # a tied alias (lm_head.weight of a tied head) is filled from its partner's checkpoint entry
        found = next((a for a in [key, *aliases[key]] if a in named), None)
        if found is not None:
            sources[key] = named[found]
        elif key in fused and fused[key][0] in named:
            sources[key], slices[key] = named[fused[key][0]], fused[key][1]
        elif t.is_meta:
            return None  # a weight the checkpoint lacks: leave it to from_pretrained
    return sources, slices


def _check_expert_shapes(src: Path, model: nn.Module, weights: "LazyWeights") -> None:
    """check_weights_match compared the tensors the fused skeleton shares with the checkpoint by name; the expert
    Linears split off it (and keys renamed for them) are compared here, once their checkpoint keys are known."""
    keys = [k for k, c in weights.sources.items() if k not in weights.slices and (k != c or ".experts." in k)]
    if not keys:
        return
    shapes, state = safetensors_shapes(src) or {}, model.state_dict()
    wrong = [k for k in keys if shapes.get(weights.sources[k]) != tuple(state[k].shape)]
    if wrong:
        key = weights.sources[wrong[0]]
        raise UserError(f"config.json in '{src}' does not match its weights: {key} is {list(shapes[key])} in the "
                        f"safetensors files but the config makes it {list(state[wrong[0]].shape)}; fix config.json "
                        "or re-save the model with save_pretrained")


def open_lazy(model: str | None, dtype: str = "auto"):
    """(model, tokenizer or None, source folder, LazyWeights), or None when only a full load will do."""
    from transformers import GenerationConfig

    src = resolve_model_dir(model)
    config = read_config(src)
    files = checkpoint_files(src)
    if files is None:
        return None
    m = meta_model(config, resolve_dtype(dtype, config))
    check_weights_match(src, m)
    check_linear_projections(m)
    unfuse_experts(m)  # one meta Linear per expert projection, read per layer like any other
    weights = LazyWeights(m, files, {})
    found = _source_keys(m, files, weights.aliases, getattr(config, "model_type", None))
    if found is None:
        return None
    weights.sources, weights.slices = found
    _check_expert_shapes(src, m, weights)
    in_layers = f"{weights.layers_name}."
    weights.materialise([k for k in weights.sources if not k.startswith(in_layers)])
    try:  # from_pretrained reads generation_config.json too; the writer copies it
        m.generation_config = GenerationConfig.from_pretrained(src)
    except Exception:
        pass
    return m, load_tokenizer(src), src, weights
