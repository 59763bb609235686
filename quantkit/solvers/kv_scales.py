"""Per-layer FP8 KV-cache scales (k_scale, v_scale) from the keys and values the attention actually caches.

The layer is run on its calibration inputs with a recording Cache passed in: attention hands `update()` the
keys after RoPE (and after any k-norm), exactly what an FP8 cache stores, so no per-architecture code is
needed to reproduce the rotary embedding. Scale >= absmax * margin / 448: keys and values at inference can
exceed what calibration saw (other prompts, longer contexts, attention sinks), and on the E4M3 grid a margin
is nearly free: relative precision is the same in every binade, so it only moves the smallest values one binade
closer to the subnormals, while a value beyond the range would be clipped. Within the octave above that floor
the scale is searched like a static input scale (fp8_input_scale.py): the one whose roundings of the cached
keys (values) cost the least, every head-dim channel counted alike, each token-head row relative to itself.
"""
from __future__ import annotations

import inspect

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicLayer

from ..distributed import Pool
from ..errors import UserError
from .base import LayerTransform
from .fp8_input_scale import InputScale

DEFAULT_MARGIN = 1.5


class _ScaleLayer(DynamicLayer):
    """Keeps nothing but the statistics of what would have been cached (absmax and log2 histogram)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.k_stats: InputScale | None = None
        self.v_stats: InputScale | None = None

    def update(self, key_states, value_states, *args, **kwargs):
        if self.k_stats is None:
            self.k_stats = InputScale("cached keys", torch.ones(1, key_states.shape[-1]))
            self.v_stats = InputScale("cached values", torch.ones(1, value_states.shape[-1]))
        self.k_stats.add(key_states)
        self.v_stats.add(value_states)
        return key_states, value_states


class ScaleRecorder(Cache):
    """A Cache that caches nothing: each forward sees an empty past, so it is a plain prefill."""

    def __init__(self):
        super().__init__(layer_class_to_replicate=_ScaleLayer)

    def stats(self, layer_idx: int) -> tuple[InputScale, InputScale]:
        if (layer_idx >= len(self.layers) or not isinstance(self.layers[layer_idx], _ScaleLayer)
                or self.layers[layer_idx].k_stats is None):
            raise UserError(f"decoder layer {layer_idx} never wrote to its KV cache during calibration, so it "
                            "has no FP8 KV scale; this architecture is not supported by quant.kv_cache fp8")
        layer = self.layers[layer_idx]
        return layer.k_stats, layer.v_stats


def cache_kwarg(module: nn.Module) -> str:
    """The name a decoder layer (or model) takes its Cache under: `cache` in transformers 5.x, else the old one."""
    params = inspect.signature(module.forward).parameters
    for name in ("cache", "past_key_values", "past_key_value"):
        if name in params:
            return name
    raise UserError(f"{type(module).__name__} takes no KV cache argument, so FP8 KV scales cannot be calibrated; "
                    "drop quant.kv_cache fp8")


def attention_of(layer: nn.Module) -> tuple[str, nn.Module]:
    """(name within the layer, module) of the layer's self-attention: the module that owns layer_idx."""
    for name, mod in layer.named_modules():
        if name and hasattr(mod, "layer_idx") and type(mod).__name__.endswith("Attention"):
            return name, mod
    raise UserError(f"cannot find the attention module of {type(layer).__name__}; quant.kv_cache fp8 supports "
                    "llama-style decoder layers")


def kv_scale_tensors(prefix: str, k_stats: InputScale, v_stats: InputScale, dtype: torch.dtype,
                     margin: float = DEFAULT_MARGIN) -> dict[str, torch.Tensor]:
    """Checkpoint tensors {prefix.k_scale, prefix.v_scale}, shape [1] in the model dtype (compressed-tensors'
    layout for a per-tensor scale)."""
    return {f"{prefix}.k_scale": k_stats.scale(dtype, margin)[0].to(dtype),
            f"{prefix}.v_scale": v_stats.scale(dtype, margin)[0].to(dtype)}


class KVScaleObserver(LayerTransform):
    """Pipeline transform: records each decoder layer's KV statistics over the calibration inputs.

    It runs before the layer's Linears are solved, i.e. on the float k_proj/v_proj of this layer fed by the
    already-quantised previous layers.
    """

    def __init__(self, model):
        super().__init__(model)
        from ..models.hf import decoder_layers

        self.layers_name, _ = decoder_layers(model)
        self.margin = DEFAULT_MARGIN
        self.dtype = next(model.parameters()).dtype

    def apply(self, layer_index: int, layer, inputs, targets: dict) -> dict:
        attn_name, attn = attention_of(layer)
        kw_name = cache_kwarg(layer)
        rec = ScaleRecorder()
        with torch.no_grad():
            for h, kw in zip(inputs.hidden, inputs.kwargs):
                kw = {k: v for k, v in kw.items() if k not in ("cache", "past_key_values", "past_key_value")}
                layer(h, **kw, **{kw_name: rec, "use_cache": True})
        k_stats, v_stats = rec.stats(attn.layer_idx)
        k_stats.reduce(Pool)  # every rank's keys and values (a no-op in one process)
        v_stats.reduce(Pool)
        prefix = f"{self.layers_name}.{layer_index}.{attn_name}"
        tensors = kv_scale_tensors(prefix, k_stats, v_stats, self.dtype, self.margin)
        return {"stats": {}, "tensors": tensors}


def calibrate_kv_scales(model, samples: list[torch.Tensor], margin: float = DEFAULT_MARGIN) -> dict[str, torch.Tensor]:
    """The same scales for a whole in-memory model (float or quantised) in one pass per sample.

    For benchmarks and runtime use where no layer-by-layer pipeline runs; returns checkpoint-style keys.
    """
    from ..models.hf import decoder_layers

    layers_name, layers = decoder_layers(model)
    rec = ScaleRecorder()
    kw_name = cache_kwarg(model)
    dev = next(model.parameters()).device
    with torch.no_grad():
        for ids in samples:
            model(input_ids=ids.reshape(1, -1).to(dev), use_cache=True, **{kw_name: rec})
    dtype = next(model.parameters()).dtype
    out = {}
    for i, layer in enumerate(layers):
        attn_name, attn = attention_of(layer)
        k, v = rec.stats(attn.layer_idx)
        out.update(kv_scale_tensors(f"{layers_name}.{i}.{attn_name}", k, v, dtype, margin))
    return out
