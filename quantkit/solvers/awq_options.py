"""AWQ's knobs (recipe quant.awq) and their defaults, written here only: the recipe schema embeds this model
and AWQTransform (awq.py) reads it. Kept apart from the solver so reading a recipe never imports torch."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .options import StrictOptions, renamed

# 2048 tokens: the alpha search is most of AWQ's cost on a CPU (awq.py); bench/awq_quality.py --search-tokens
# measures what a larger budget buys
SEARCH_TOKENS = 2048
# the clip's decorrelation prior (awq_clip.py). 2048: halving the off-diagonal part on 2,048 tokens of Python
# took AWQ's worst held-out text (prose) from 58% to 66% of the RTN gap (a third and three quarters did about as well, the diagonal alone less well); on 26k
# self-generated tokens neither a half nor the 0.07 this gives moved AWQ or AWQ+GPTQ beyond the noise, so the
# prior fades where the evidence is large (docs/benchmarks.md, "A clip that carries across domains")
CLIP_PRIOR_TOKENS = 2048


class AWQOptions(StrictOptions):
    """AWQ: activation-aware per-channel scales folded into the preceding op (method awq or awq+gptq)."""

    grid: int = Field(20, ge=2, description="Points of the alpha grid in [0, 1].")
    duo: bool = Field(False, description="Use s = mean|x|^a / mean|w|^(1-a) instead of mean|x|^a.")
    clip: bool = Field(True, description="Per-group clip search after scaling.")
    search_tokens: int = Field(SEARCH_TOKENS, ge=1, description="Calibration tokens (whole samples, at least one) "
                               "the alpha search runs through each block; the main cost of AWQ.")
    fallback: Literal["error", "rtn"] = Field(
        "error", description="What to do with an architecture that has no AWQ map.")
    # 0.1: on the full-range grid, across three calibration sources x three held-out texts (bench/cross_domain.py),
    # it beat 0.05 and 0.2 on the mean and the worst text, alone and under GPTQ (docs/benchmarks.md)
    min_gain: float = Field(0.1, ge=0, lt=1, description="Least share by which a stronger scaling must lower the "
                            "block error against every milder one, no scaling (alpha 0) included; the mildest "
                            "alpha within this share of the best is kept (0: the best). Formerly 'tolerance'.")
    clip_prior_tokens: int = Field(CLIP_PRIOR_TOKENS, ge=0, description="The clip search drops prior / (prior + "
                                   "tokens) of each Gram block's off-diagonal part, tokens being those it was "
                                   "measured on: a few thousand tokens of one domain do not fit the clip to that "
                                   "domain's channel correlations (0: the Gram as measured).")

    @model_validator(mode="before")
    @classmethod
    def _old_tolerance(cls, data):
        return renamed(data, "tolerance", "min_gain", "quant.awq")  # 'tolerance' hid what the knob does
