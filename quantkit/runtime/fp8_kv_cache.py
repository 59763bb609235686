"""FP8KVCache: a transformers Cache that keeps keys and values as float8_e4m3fn, one byte per element.

Each layer has a fixed per-tensor k_scale and v_scale, calibrated at quantisation time (`--kv-cache fp8`) and
loaded onto the attention modules (see loader.py). New keys/values are quantised (saturating at ±448) as they
arrive; attention receives the whole cache dequantised to the model dtype, so the current step's keys go through
FP8 too, as they would in an FP8 attention kernel. Fixed scales make the stored codes independent of what comes
later, so appending, cropping (speculative rollback) and beam reordering work on the codes directly.

Works as `model.generate(..., past_key_values=FP8KVCache.from_model(model))` and in a plain forward loop.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from .. import e4m3
from ..errors import UserError


class FP8Layer(DynamicLayer):
    """DynamicLayer whose `keys`/`values` hold e4m3 codes; everything that only slices them (crop, reorder,
    batch selection, seq length) is inherited unchanged."""

    def __init__(self, k_scale: float | torch.Tensor, v_scale: float | torch.Tensor, **kwargs):
        super().__init__(**kwargs)
        self.k_scale = torch.as_tensor(k_scale, dtype=torch.float32).reshape(())
        self.v_scale = torch.as_tensor(v_scale, dtype=torch.float32).reshape(())
        if not (self.k_scale > 0 and self.v_scale > 0 and torch.isfinite(self.k_scale) and torch.isfinite(self.v_scale)):
            raise UserError(f"FP8 KV scales must be positive and finite, got k={float(self.k_scale)}, "
                            f"v={float(self.v_scale)}; re-run quantkit quantize --set quant.kv_cache=fp8")
        self.dtype = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.k_scale = self.k_scale.to(self.device)
        self.v_scale = self.v_scale.to(self.device)
        self.keys = torch.empty(*key_states.shape[:-2], 0, key_states.shape[-1], dtype=e4m3.FP8, device=self.device)
        self.values = torch.empty(*value_states.shape[:-2], 0, value_states.shape[-1], dtype=e4m3.FP8,
                                  device=self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = torch.cat([self.keys, e4m3.quantize(key_states, self.k_scale)], dim=-2)
        self.values = torch.cat([self.values, e4m3.quantize(value_states, self.v_scale)], dim=-2)
        return (e4m3.dequantize(self.keys, self.k_scale, key_states.dtype),
                e4m3.dequantize(self.values, self.v_scale, value_states.dtype))

    def nbytes(self) -> int:
        if not self.is_initialized:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


class FP8KVCache(Cache):
    def __init__(self, k_scales: list, v_scales: list):
        if len(k_scales) != len(v_scales) or not k_scales:
            raise UserError("FP8KVCache needs one k_scale and one v_scale per decoder layer")
        super().__init__(layers=[FP8Layer(k, v) for k, v in zip(k_scales, v_scales)])

    @classmethod
    def from_model(cls, model) -> "FP8KVCache":
        """Scales from the `k_scale`/`v_scale` buffers the loader put on each attention module."""
        config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") \
            else model.config
        kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
        if kinds != {"full_attention"}:
            raise UserError(f"the FP8 KV cache supports full-attention layers only, this model has {sorted(kinds)}; "
                            "drop --kv-cache fp8")
        n = config.num_hidden_layers
        scales: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for m in model.modules():  # indexed by layer_idx: the index attention passes to Cache.update
            k, v = getattr(m, "k_scale", None), getattr(m, "v_scale", None)
            if isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) and hasattr(m, "layer_idx"):
                scales[int(m.layer_idx)] = (k.detach().float().cpu(), v.detach().float().cpu())
        missing = [i for i in range(n) if i not in scales]
        if missing:
            raise UserError(f"decoder layer {missing[0]} has no k_scale/v_scale ({len(missing)} of {n} lack them); "
                            "quantise with --set quant.kv_cache=fp8 to use the FP8 KV cache")
        ks = [scales[i][0] for i in range(n)]
        vs = [scales[i][1] for i in range(n)]
        return cls(ks, vs)

    def nbytes(self) -> int:
        """Bytes held by the stored keys and values (the scales are a few bytes per layer and not counted)."""
        return sum(layer.nbytes() for layer in self.layers)
