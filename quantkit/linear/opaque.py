"""An inference-only Linear whose weight lives in a kernel library's own layout (oneDNN's blocks, FBGEMM's float16
panels) rather than as a plain tensor.

What such a module must still do as an nn.Linear would: report the plain [out, in] weight, write it into a
state_dict and take it back from one, and follow `.to()` / `.half()`, which reach parameters and buffers only
and so would miss a weight held in an opaque object. Subclasses say how a plain weight becomes the held form
(`_set_weight`), how it comes back (`weight`), and what the product is (`forward`).
"""
from __future__ import annotations

import torch
from torch import nn


class OpaqueLinear(nn.Module):
    layout = "plain"  # named in repr

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        with torch.no_grad():
            self._hold(weight.detach())

    def _hold(self, w: torch.Tensor) -> None:
        self.dtype = w.dtype  # the plain weight's dtype, known without rebuilding it from the held form
        self._set_weight(w)

    def _set_weight(self, w: torch.Tensor) -> None:
        raise NotImplementedError

    @property
    def weight(self) -> torch.Tensor:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        """Bytes of the weight as held (what a decode step reads)."""
        raise NotImplementedError

    def _apply_extra(self, fn) -> None:
        """Convert anything else the subclass holds outside parameters and buffers."""

    def _loaded(self, w: torch.Tensor) -> None:
        """A new plain weight came from a state_dict: update anything else derived from it."""

    def _apply(self, fn, recurse=True):
        plain = getattr(self, "plain", None)
        device = plain.device if plain is not None else torch.device("cpu")  # held layouts live on the CPU
        probe = fn(torch.empty(0, dtype=self.dtype, device=device))
        # `.float()` on a float32 model, `.cpu()` on a CPU one: the held weight stays as it is (rebuilding it
        # would cost an unpack and a repack, and would take it out of any pack it shares: fuse_modules)
        weight = None if probe.dtype == self.dtype and probe.device == device else fn(self.weight)
        super()._apply(fn, recurse)
        with torch.no_grad():
            if weight is not None:
                self._hold(weight.detach())
            self._apply_extra(fn)
        return self

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # an opaque layout is no state a checkpoint can hold: save the plain weight, as nn.Linear would
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.weight

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        key = prefix + "weight"
        w = state_dict.pop(key, None)  # load_state_dict hands each module a copy of the caller's dict
        if w is None:
            missing_keys.append(key)
        elif tuple(w.shape) != (self.out_features, self.in_features):
            error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(w.shape)}, the "
                              f"shape in current model is {(self.out_features, self.in_features)}.")
            w = None
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if w is not None:
            with torch.no_grad():
                self._hold(w.detach().to(self.dtype).clone())
                self._loaded(w)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, " \
               f"{self.layout}"
