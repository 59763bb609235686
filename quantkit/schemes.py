"""Quantisation schemes: what a Linear's weights (and activations) become, independent of how they are solved."""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch

from .errors import UserError


@dataclass(frozen=True)
class Scheme:
    name: str
    num_bits: int
    type: str  # "int" or "float" (8 bits: E4M3; 4 bits: E2M1, quantkit/fp4.py)
    symmetric: bool = True
    group_size: int = 128  # -1: one group per output channel
    actorder: str | None = None  # None or "weight" (static groups, no g_idx)
    # activations: None (weight-only), "dynamic" (per token at run time) or "static" (calibrated per tensor)
    activations: str | None = None
    weight_strategy_override: str | None = None  # "tensor" for fp8 static, "tensor_group" for nvfp4
    # symmetric integer weights: each group's largest-magnitude weight lands on qmin (-8 at 4 bits), so the
    # step is absmax / 8, not absmax / 7, and the scale's sign says which side that weight was on. The checkpoint
    # format is unchanged (codes times scale); only the chosen scale differs (solvers/rtn.py: qparams).
    full_range: bool = False

    @property
    def is_fp8(self) -> bool:
        return self.type == "float" and self.num_bits == 8

    @property
    def is_fp4(self) -> bool:
        """E2M1 values with a scale per group of the format's fixed size (16: nvfp4, 32: mxfp4)."""
        return self.type == "float" and self.num_bits == 4

    @property
    def is_int_activations(self) -> bool:
        """INT8 weights and INT8 activations (W8A8): one int8 x int8 product per Linear."""
        return self.type == "int" and self.activations is not None

    @property
    def strategy(self) -> str:
        if self.weight_strategy_override:
            return self.weight_strategy_override
        return "channel" if self.group_size == -1 else "group"

    @property
    def qmin(self) -> int:
        return -(1 << (self.num_bits - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.num_bits - 1)) - 1

    def with_options(self, **kw) -> "Scheme":
        kw = {k: v for k, v in kw.items() if v is not None}
        return replace(self, **kw)

    def to_dict(self) -> dict:
        return asdict(self)


PRESETS: dict[str, Scheme] = {
    "w4a16": Scheme("w4a16", 4, "int", True, 128),
    "w8a16": Scheme("w8a16", 8, "int", True, -1),
    # below 4 bits a group's one scale has to cover fewer weights to keep the error bounded: smaller default groups
    "w3a16": Scheme("w3a16", 3, "int", True, 64),
    "w2a16": Scheme("w2a16", 2, "int", True, 32),
    "fp8": Scheme("fp8", 8, "float", True, -1, activations="static", weight_strategy_override="tensor"),
    "fp8-dynamic": Scheme("fp8-dynamic", 8, "float", True, -1, activations="dynamic"),
    # weight-only FP4; the group sizes are the formats' own and cannot be changed
    "nvfp4": Scheme("nvfp4", 4, "float", True, 16, weight_strategy_override="tensor_group"),
    "mxfp4": Scheme("mxfp4", 4, "float", True, 32),
    # nvfp4 weights and activations: E2M1 per 16 at run time under a static (calibrated) global input scale
    "nvfp4-a4": Scheme("nvfp4-a4", 4, "float", True, 16, activations="static",
                       weight_strategy_override="tensor_group"),
    # INT8 weights per channel and INT8 activations (compressed-tensors `int-quantized`, the W8A8 preset)
    "w8a8": Scheme("w8a8", 8, "int", True, -1, activations="dynamic"),
    "w8a8-static": Scheme("w8a8-static", 8, "int", True, -1, activations="static"),
}


def get_scheme(name: str) -> Scheme:
    if name not in PRESETS:
        import difflib

        close = difflib.get_close_matches(name, PRESETS, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise UserError(f"unknown scheme '{name}'{hint}; choose one of: {', '.join(PRESETS)}")
    return PRESETS[name]


def scale_dtype_for(storage: torch.dtype) -> torch.dtype:
    """The dtype scales are stored, and codes solved against, for a checkpoint written in STORAGE: the same
    dtype, except that float32 checkpoints keep float16 scales, the widest every engine's W4 kernel reads."""
    return storage if storage != torch.float32 else torch.float16


def fitting_group_size(widths, preferred: int) -> int | None:
    """The largest of PREFERRED, /2, /4 dividing every width (SmolLM2's 576-wide projections take 64 for a
    preferred 128), or None; the rule quantize applies when the user gave no group size, and the self-draft too."""
    return next((g for g in (preferred, preferred // 2, preferred // 4) if g and all(w % g == 0 for w in widths)),
                None)
