"""Per-layer reading and dropping of weights when the model was opened lazily (models/lazy.py)."""
from __future__ import annotations

from ..schemes import Scheme


class LayerStream:
    """The per-layer load/release calls of lazy loading; does nothing for a fully loaded model."""

    def __init__(self, weights, schemes: dict[str, Scheme], layers_name: str):
        self.weights = weights
        self.schemes = schemes
        self.layers_name = layers_name

    def targets(self, i: int) -> list[str]:
        return [n for n in self.schemes if n.startswith(f"{self.layers_name}.{i}.")]

    def load(self, i: int) -> None:
        if self.weights is not None:
            self.weights.load_layer(i)

    def release(self, i: int) -> None:
        if self.weights is not None:
            self.weights.release(self.targets(i))
