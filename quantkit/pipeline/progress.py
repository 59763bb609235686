"""The pipeline's progress: layers done and calibration samples fed, on a rich Progress or on nothing."""
from __future__ import annotations


class LayerProgress:
    """The pipeline runs the same with or without a rich Progress (tests and --quiet pass none)."""

    def __init__(self, progress, n_layers: int, n_samples: int):
        self.p = progress
        if progress is not None:
            self.layers = progress.add_task("layers", total=n_layers)
            self.samples = progress.add_task("calibration samples", total=n_samples, visible=n_samples > 0)

    def sample(self) -> None:
        if self.p is not None:
            self.p.advance(self.samples)

    def layer(self, desc: str) -> None:
        if self.p is not None:
            self.p.advance(self.layers)
            self.p.update(self.layers, description=desc)
            self.p.reset(self.samples)
