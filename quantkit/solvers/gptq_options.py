"""GPTQ's knobs (recipe quant.gptq) and their defaults, written here only: the recipe schema embeds this model
and GPTQSolver (gptq_solver.py) reads it. Kept apart from the solver so reading a recipe never imports torch."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator
from pydantic_core import PydanticCustomError

from .options import StrictOptions


# the Hessian's decorrelation prior (decorrelation.py). 2048, the AWQ clip's prior: calibrated on 2,048 tokens of
# code, quotes or man pages (a share of 0.5), AWQ+GPTQ became the best method in-domain (1.1-2.3% below AWQ+GPTQ
# without it) and beat RTN on both other domains, where without it it lost to RTN by 2.8% (code -> quotes); on
# the default 65,536 tokens the share is 0.03 (docs/benchmarks.md, "GPTQ at every calibration size")
PRIOR_TOKENS = 2048


class GPTQOptions(StrictOptions):
    """GPTQ: Hessian-based error compensation, column by column (method gptq or awq+gptq)."""

    damp: float = Field(0.01, gt=0, lt=1, description="Dampening as a fraction of the Hessian's mean diagonal.")
    block_size: int = Field(128, ge=1, description="Columns updated together (lazy batch updates).")
    # 'weight' by default: on every model and text measured it beat 'off' in the same CPU time
    # (docs/benchmarks.md, "GPTQ's default act-order")
    actorder: Literal["off", "weight"] = Field(
        "weight", description="'weight': quantise columns by decreasing Hessian diagonal, groups kept in order "
                           "(no g_idx, loads everywhere). Integer schemes only; FP8 GPTQ keeps column order.")
    static_groups: bool = Field(True, description="Fix group scales before reordering (no g_idx with 'weight').")
    prior_tokens: int = Field(PRIOR_TOKENS, ge=0, description="The solve drops prior / (prior + tokens) of the "
                              "Hessian's off-diagonal part, tokens being those it was measured on: a few thousand "
                              "tokens of one domain do not fit GPTQ to that domain's channel correlations (0: the "
                              "Hessian as measured).")

    @field_validator("actorder", mode="before")
    @classmethod
    def _no_group_actorder(cls, v):
        if v is False:  # YAML 1.1 reads a bare `off` as false, in recipe files and in --set alike
            return "off"
        if v == "group":
            # the 'key' in ctx lets the recipe's error reporter point at this key's own line
            raise PydanticCustomError(
                "removed_actorder", "actorder 'group' writes a g_idx layout that current vLLM and compressed-"
                "tensors refuse to load; use 'weight' (the same column order, groups kept in place)", {"key": v})
        return v
