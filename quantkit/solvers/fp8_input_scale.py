"""The static FP8 input scale of one Linear, chosen from its calibration inputs.

E4M3 is a floating-point grid: in its normal range the relative rounding error of a value depends only on where
value/scale falls between two powers of two, so every scale in one octave [s, 2s) gives a different set of
roundings of the same size on average, and a power-of-two change of scale gives the same roundings again. Per
token, dynamic scales are lucky by construction (each row's largest input maps exactly onto 448); a static scale
is not, and on SmolLM2-135M the luck of the draw moves a q_proj's output error by 10% (1.64-1.90%, relative).

So the scale is searched: the calibration inputs are kept as a histogram over their float32 exponent and top 8
mantissa bits (256 bins per octave, each at most 0.4% wide, read off the bit pattern with a shift), each entry
weighted by x^2 times the squared norm of the weight column it multiplies (the diagonal of
W^T W, so an input error counts by the output error it causes). Any candidate scale's output error is then a sum
over the bins of E4M3's squared relative error at the bin's value, subnormals and saturation included. The
candidates are the scales representable in the storage dtype in [absmax*margin, 2*absmax*margin)/448: the
margin keeps the headroom for inputs larger than calibration saw, and one octave holds every rounding pattern.
Memory is the histogram (64k floats), whatever the number of calibration tokens. The FP8 KV cache's k_scale and
v_scale are chosen the same way (kv_scales.py), with every head-dim channel weighted alike.
"""
from __future__ import annotations

import copy

import torch

from .. import e4m3
from ..errors import UserError

# A non-negative float32's bits >> 15 are its 8 exponent bits and top 8 mantissa bits: the bin, with no log2.
_BIN_SHIFT = 15
_NBINS = 1 << 16
# Candidate scales per octave for a float32 scale: finer steps than 0.27% only re-pick roundings that the
# histogram's bins cannot tell apart. A 16-bit scale tries every value of its octave (128 or 1024).
_MAX_CANDIDATES = 256
_CHUNK_ELEMENTS = 1 << 22  # inputs scored per step in add(): 16 MB of float32

# Static input scale >= calibration absmax x INPUT_MARGIN / 448. Run-time inputs exceed what a calibration set saw:
# on SmolLM2-135M, 95 of 210 Linears met larger inputs in held-out prose than in 2.5k calibration tokens, up to
# 2.24x (bench/fp8_error_split.py), and a saturated outlier is ruinous (clipping at half the absmax: +63%
# perplexity). E4M3 keeps its relative precision in every binade, so one binade of headroom only pushes the
# smallest values one binade nearer the subnormals.
INPUT_MARGIN = 2.0


def candidate_scales(base: float, dtype: torch.dtype) -> torch.Tensor:
    """Scales in [base, 2*base) exactly representable in dtype, ascending; base must be representable."""
    if torch.finfo(dtype).bits == 16:  # every value of the octave: consecutive bit patterns of a positive float
        per_octave = round(1 / torch.finfo(dtype).eps)
        codes = torch.tensor(base, dtype=dtype).view(torch.int16) + torch.arange(per_octave, dtype=torch.int16)
        c = codes.view(dtype).float()
    else:
        c = (base * torch.exp2(torch.arange(_MAX_CANDIDATES, dtype=torch.float64) / _MAX_CANDIDATES)).to(dtype).float()
    # near the top of a 16-bit range the octave runs into inf and NaN bit patterns: never a scale
    return c[torch.isfinite(c)]


class InputScale:
    """Running statistics of a Linear's calibration inputs (absmax and the weighted log2 histogram)."""

    def __init__(self, name: str, weight: torch.Tensor):
        self.name = name
        # the squared norm of each input column: an error e_j in input j moves the outputs by |W[:, j]| e_j
        self.col_weight = weight.detach().float().pow(2).sum(0)
        self.amax = torch.zeros(())
        self.hist = torch.zeros(_NBINS, dtype=torch.float64)
        self.tokens = 0

    def add(self, x: torch.Tensor) -> None:
        """Count a batch of inputs [..., in]; the work runs where x lives (a GPU pipeline's activations stay put)."""
        x = x.detach().reshape(-1, x.shape[-1])
        if not torch.isfinite(x).all():
            raise UserError(f"NaN or Inf in the calibration inputs of {self.name}; load the model in float32 "
                            "(--dtype float32) or check the source weights")
        dev = x.device
        if self.hist.device != dev:
            self.hist, self.col_weight = self.hist.to(dev), self.col_weight.to(dev)
        self.amax = torch.maximum(self.amax.to(dev), x.abs().amax().float())
        # rows in chunks: the temporaries are a few times the chunk, not the batch (a 70B down_proj's batch of
        # 2048 tokens is 235 MB in float32)
        for rows in x.split(max(1, _CHUNK_ELEMENTS // x.shape[1])):
            a = rows.float().abs()
            energy = a * a * self.col_weight
            # each token's errors relative to its own output: a residual stream is normalised per token
            # downstream, so a sink token's huge inputs must not decide the roundings of every other token
            weight = (energy / energy.sum(1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)).flatten()
            # a zero input lands in bin 0 with weight 0: no mask needed
            pos = (a.view(torch.int32) >> _BIN_SHIFT).flatten()
            self.hist += torch.bincount(pos, weights=weight, minlength=_NBINS).double()
        self.tokens += x.shape[0]

    def reduce(self, pool) -> None:
        """Every rank's inputs counted (distributed.Pool): the histograms add, the absmax is the largest."""
        self.amax = pool.max(self.amax.float().reshape(()).clone())
        pool.sum(self.hist)
        self.tokens = pool.count(self.tokens)

    def merged(self, others: list["InputScale"]) -> "InputScale":
        """Statistics of Linears that read the same inputs, scored together: the sum of each one's per-token
        relative output error (the histograms add; absmax and token counts are the same inputs seen again)."""
        out = copy.copy(self)
        out.hist = self.hist.clone()
        for o in others:
            if o.tokens != self.tokens:
                raise ValueError(f"{o.name} saw {o.tokens} calibration tokens and {self.name} {self.tokens}: "
                                 "they do not read the same inputs")
            out.hist += o.hist.to(out.hist.device)
            out.amax = torch.maximum(out.amax, o.amax.to(out.amax.device))
        return out

    def errors(self, scales: torch.Tensor) -> torch.Tensor:
        """Estimated weighted squared output error of each candidate scale, from the histogram."""
        hist = self.hist.cpu()
        used = torch.nonzero(hist).flatten()
        # each bin's midpoint: its bit pattern with the highest of the dropped mantissa bits set
        centers = ((used.int() << _BIN_SHIFT) | (1 << (_BIN_SHIFT - 1))).view(torch.float32).double()
        weight = hist[used]
        out = []
        for chunk in scales.reshape(-1, 1).split(64):  # [64, bins] at a time: bounded memory for 1024 candidates
            q = e4m3.fake_quantize(centers.float().expand(len(chunk), -1), chunk).double()
            out.append((weight * ((q - centers) / centers) ** 2).sum(1))
        return torch.cat(out)

    def scale(self, dtype: torch.dtype, margin: float = INPUT_MARGIN) -> tuple[torch.Tensor, dict]:
        """The chosen scale ([1], float32 holding a dtype-representable value) and what the choice rests on."""
        if self.tokens == 0:
            raise UserError(f"{self.name} saw no calibration tokens, so it has no static FP8 input scale; "
                            "leave it in --ignore or use the fp8-dynamic scheme")
        base = e4m3.scale_for(self.amax.cpu().reshape(1), margin, dtype=dtype)
        stats = {"input_amax": float(self.amax), "input_margin": margin, "calib_tokens": self.tokens}
        if float(self.amax) == 0.0:  # all-zero inputs: nothing to choose, the floor scale keeps them exact
            return base, stats
        cands = candidate_scales(float(base), dtype)
        if len(cands) == 0:
            raise UserError(f"the calibration inputs of {self.name} reach {float(self.amax):.3g}, too large for a "
                            f"{str(dtype).removeprefix('torch.')} scale; quantise with --dtype bfloat16")
        err = self.errors(cands)
        best = int(torch.argmin(err))
        stats["input_scale_gain"] = float(1 - err[best] / err[0]) if err[0] > 0 else 0.0
        return cands[best].reshape(1), stats

    def attach(self, qw, scale_dtype: torch.dtype) -> None:
        qw.input_scale, stats = self.scale(scale_dtype)
        qw.stats.update(stats)
