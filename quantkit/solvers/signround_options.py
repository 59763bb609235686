"""Learned rounding's knobs (recipe quant.signround) and their defaults, written here only: the recipe schema
embeds this model and SignRoundTransform (signround.py) reads it. Kept apart from the solver so reading a recipe
never imports torch."""
from __future__ import annotations

from pydantic import Field

from .options import StrictOptions


class SignRoundOptions(StrictOptions):
    """Learned rounding (method signround): signed-gradient descent on rounding offsets and clip factors."""

    iters: int = Field(40, ge=1, description="Signed-gradient steps per decoder layer (the AutoRound paper "
                                             "uses 200; 40 is a CPU budget: 1.7x GPTQ's CPU time on SmolLM2-135M).")
    lr: float | None = Field(None, gt=0, description="Step size, decaying linearly to 0; empty = 1 / iters.")
    batch: int = Field(2, ge=1, description="Calibration samples per step.")
    clip: bool = Field(True, description="Also learn each group's clip factors for its max and min (in [0.5, 1]).")
