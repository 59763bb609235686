"""The lazily opened float model (models/lazy.py), called like a loaded one: each decoder layer's weights are read
from disk just before the layer runs and dropped again after it, so a forward holds one layer of float weights.

It reads the whole model once per call, so it is for the few calls that must be the float model's own where it
does not fit: a memory-capped run's self-sampled calibration takes its openings from it. Those openings (the
first token of each sample, drawn from the top 1,024 of the next-token distribution after the start token) are
where a round-to-nearest copy's distribution differs most: SmolLM2-135M's default, calibrated on text its W8 copy
sampled from its own openings, scored +1.23% perplexity above the float-sampled run (five seeds, 8 x 128 tokens),
and -0.36% with the float model's openings and the copy's continuations (docs/distributed.md).
"""
from __future__ import annotations

from torch import nn

from .lazy import LazyWeights


class StreamedForward(nn.Module):
    def __init__(self, weights: LazyWeights):
        super().__init__()
        self.weights = weights
        self.inner = weights.model  # the lazily opened model: embeddings, norms and head read, layers on meta
        self.config = self.inner.config
        self.eval()

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()

    def forward(self, **inputs):
        w, hooks = self.weights, []
        for i, layer in enumerate(w.layers):
            hooks.append(layer.register_forward_pre_hook(lambda *_, i=i: w.load_layer(i)))
            hooks.append(layer.register_forward_hook(lambda *_, i=i: w.unload_layer(i)))
        try:
            return self.inner(**inputs)
        finally:
            for h in hooks:
                h.remove()
