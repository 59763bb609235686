"""SmoothQuant's knobs (recipe quant.smoothquant, used when quant.smooth is on) and their defaults, written here
only: the recipe schema embeds this model and SmoothQuantTransform (smoothquant.py) reads it. Kept apart from the
solver so reading a recipe never imports torch."""
from __future__ import annotations

from pydantic import Field

from .options import StrictOptions


class SmoothQuantOptions(StrictOptions):
    """SmoothQuant (quant.smooth, w8a8 schemes): per-channel scales moving activation outliers into the weights."""

    alpha: float | None = Field(None, ge=0, le=1, description="Migration strength; empty = searched per layer on "
                                "an 11-point grid in [0, 1] by the W8A8 output error (no smoothing when none "
                                "beats it). Formerly quant.smooth_alpha.")
