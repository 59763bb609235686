"""The static INT8 input scale of one Linear (scheme w8a8-static), chosen from its calibration inputs.

The statistics are fp8_input_scale.InputScale's (a histogram of the inputs over their float32 exponent and top
mantissa bits, each entry weighted by its share of the token's output energy); only the grid differs. An INT8
grid is uniform, so a scale trades two errors against each other: inputs above 127 x scale are clipped, and
everything below is rounded to steps of one scale. The candidates are the storage dtype's values of
absmax x r / 127 for r on a grid in [MIN_RATIO, 1]; the one with the least estimated output error is kept.

Unlike FP8 there is no headroom above the calibration absmax: one binade of headroom costs an INT8 grid one of
its 8 bits everywhere, while an FP8 grid loses nothing. Inputs larger than calibration saw are clipped at run
time, which is why per-token dynamic scales (`w8a8`) are the default scheme.
"""
from __future__ import annotations

import torch

from ..errors import UserError
from .fp8_input_scale import _BIN_SHIFT, InputScale

QMAX = 127
MIN_RATIO = 0.25
RATIOS = 64


def int8_error(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Expected squared error of INT8-rounding `values` [bins] (each a histogram bin's centre, > 0) with each of
    `scales` [k], as [k, bins]: clipping above 127 x scale; below it the exact rounding error of the centre when
    a bin is narrower than one step, else the uniform-rounding mean scale^2 / 12 (a wide bin's values fall
    anywhere between two steps)."""
    v = values.double().reshape(1, -1)
    s = scales.double().reshape(-1, 1)
    exact = (torch.round(v / s).clamp(-QMAX, QMAX) * s - v) ** 2
    width = v * 2.0 ** -(23 - _BIN_SHIFT)  # the bin's width: one unit of the last kept mantissa bit
    uniform = (s * s / 12).expand_as(exact)
    rounded = torch.where(width >= s, uniform, exact)
    return torch.where(v > QMAX * s, (v - QMAX * s) ** 2, rounded)


class Int8InputScale(InputScale):
    def errors(self, scales: torch.Tensor) -> torch.Tensor:
        hist = self.hist.cpu()
        used = torch.nonzero(hist).flatten()
        centers = ((used.int() << _BIN_SHIFT) | (1 << (_BIN_SHIFT - 1))).view(torch.float32).double()
        # the histogram's weights are shares of output energy (x^2 |W_j|^2 / token total): an error counts
        # relative to its input value
        return (int8_error(centers, scales) * (hist[used] / centers ** 2)).sum(1)

    def scale(self, dtype: torch.dtype, margin: float = 1.0) -> tuple[torch.Tensor, dict]:
        if self.tokens == 0:
            raise UserError(f"{self.name} saw no calibration tokens, so it has no static INT8 input scale; "
                            "leave it in --ignore or use the w8a8 scheme (per-token scales)")
        amax = max(float(self.amax), torch.finfo(torch.float32).tiny)
        ratios = torch.linspace(MIN_RATIO, 1.0, RATIOS, dtype=torch.float64)
        cands = torch.unique((amax * margin * ratios / QMAX).to(dtype).float())
        cands = cands[torch.isfinite(cands) & (cands > 0)]
        if len(cands) == 0:
            raise UserError(f"the calibration inputs of {self.name} reach {amax:.3g}, out of range for a "
                            f"{str(dtype).removeprefix('torch.')} scale; quantise with --dtype bfloat16")
        err = self.errors(cands)
        best = int(torch.argmin(err))
        stats = {"input_amax": float(self.amax), "calib_tokens": self.tokens,
                 "input_clip_ratio": round(float(cands[best]) * QMAX / amax, 4)}
        return cands[best].reshape(1), stats
