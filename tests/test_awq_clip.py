"""AWQ's clip search (solvers/awq_clip.py): the Gram-block error equals a direct error over tokens, and the
calibration text's channel correlations are trusted the less the fewer tokens measured them."""
from __future__ import annotations

import pytest
import torch

from quantkit.recipe import Recipe
from quantkit.schemes import Scheme
from quantkit.solvers.awq_clip import CLIP_DAMP, GramAccumulator, apply_clip, search_clip
from quantkit.solvers.awq_options import CLIP_PRIOR_TOKENS
from quantkit.solvers.decorrelation import decorrelation
from quantkit.solvers.rtn import rtn_quantize


@pytest.mark.parametrize("damp,decorrelate", [(0.0, 0.0), (CLIP_DAMP, 0.0), (5.0, 0.0), (0.0, 0.5),
                                              (CLIP_DAMP, 0.5), (0.0, 1.0)])
def test_clip_search_gram_error_equals_direct_output_error(damp, decorrelate):
    """The ratio chosen from X^T X blocks is the one a direct per-group error over tokens picks: every token
    scaled to unit RMS; (1 - decorrelate) x the output error plus decorrelate x the error each input channel
    would leave alone (sum_i dw_i^2 sum_t x_ti^2: the Gram's diagonal), plus the ridge term damp x mean(diag G)
    x |dw|^2."""
    g = torch.Generator().manual_seed(0)
    sch = Scheme("t", 4, "int", True, 16)
    w = torch.randn(8, 64, generator=g)
    w[:, 5] *= 6  # one large weight per row makes shrinking worthwhile
    x = torch.randn(200, 64, generator=g) * torch.exp(torch.randn(64, generator=g))
    x[::25] *= 40  # a few tokens with outsized activations, which must not outweigh the rest
    acc = GramAccumulator(64, 16, "cpu")
    acc.add(x[:120])
    acc.add(x[120:])
    ratio = search_clip(w, acc.gram, sch, grid=10, max_shrink=0.5, scale_dtype=torch.float32, damp=damp,
                        decorrelate=decorrelate)
    ratios = [1.0 - 0.5 * i / 10 for i in range(10)]
    xd = x.double()
    xg = (xd / xd.pow(2).mean(-1, keepdim=True).sqrt()).reshape(200, 4, 16)
    best = torch.zeros(8, 4)
    for o in range(8):
        for grp in range(4):
            power = xg[:, grp].pow(2).sum(0)  # per input channel, over tokens
            ridge = damp * float(power.mean())
            errs = []
            for r in ratios:
                seg = w[o:o + 1, grp * 16:(grp + 1) * 16]
                clipped = apply_clip(seg, torch.full((1, 1), r), sch)
                dw = rtn_quantize(clipped, sch, scale_dtype=torch.float32).dequantize().double() - seg.double()
                joint = float((dw @ xg[:, grp].t()).pow(2).sum())
                alone = float((dw.pow(2) * power).sum())
                errs.append((1 - decorrelate) * joint + decorrelate * alone + ridge * float(dw.pow(2).sum()))
            best[o, grp] = ratios[min(range(len(errs)), key=errs.__getitem__)]
    assert torch.equal(ratio, best)
    assert (ratio < 1).any()


def test_decorrelation_falls_as_the_calibration_text_grows():
    """Half the off-diagonal part at as many tokens as the prior, all of it with none, less with every token
    more, none with the prior off."""
    assert Recipe().quant.awq.clip_prior_tokens == CLIP_PRIOR_TOKENS  # the recipe's default is this prior
    assert decorrelation(CLIP_PRIOR_TOKENS, CLIP_PRIOR_TOKENS) == 0.5 and decorrelation(0, CLIP_PRIOR_TOKENS) == 1.0
    assert decorrelation(500, prior=0) == 0.0  # off
    shares = [decorrelation(t, CLIP_PRIOR_TOKENS) for t in (100, 2048, 8192, 65536)]
    assert shares == sorted(shares, reverse=True) and shares[-1] < 0.05


def test_decorrelating_the_gram_discounts_how_channels_move_together():
    """When a group's inputs are strongly correlated (one shared component), the full Gram lets errors of
    opposite sign cancel and chooses other clips than the diagonal alone does; decorrelate 0 follows the full
    Gram, 1 the diagonal alone, and a half differs from the full Gram (the reference above checks its numbers)."""
    g = torch.Generator().manual_seed(3)
    sch = Scheme("t", 4, "int", True, 16)
    w = torch.randn(16, 64, generator=g)
    w[:, 7] *= 5
    shared = torch.randn(400, 1, generator=g)
    x = 0.2 * torch.randn(400, 64, generator=g) + shared * torch.exp(torch.randn(64, generator=g))
    acc = GramAccumulator(64, 16, "cpu")
    acc.add(x)
    kw = dict(grid=10, max_shrink=0.5, scale_dtype=torch.float32, damp=0.0)
    full, half, diag = (search_clip(w, acc.gram, sch, decorrelate=r, **kw) for r in (0.0, 0.5, 1.0))
    diagonal_only = torch.diag_embed(torch.diagonal(acc.gram, dim1=-2, dim2=-1))
    assert torch.equal(diag, search_clip(w, diagonal_only, sch, **kw))
    assert not torch.equal(full, diag)
    assert not torch.equal(half, full)


def test_a_large_damp_chooses_the_data_free_clip():
    """With the ridge term dominant, the clip minimises the weight's own squared error, whatever the inputs."""
    g = torch.Generator().manual_seed(1)
    sch = Scheme("t", 4, "int", True, 16)
    w = torch.randn(8, 64, generator=g)
    w[:, 3] *= 5
    x = torch.randn(300, 64, generator=g) * torch.exp(2 * torch.randn(64, generator=g))
    acc = GramAccumulator(64, 16, "cpu")
    acc.add(x)
    eye = torch.eye(16).expand(4, 16, 16).contiguous()
    free = search_clip(w, eye, sch, grid=10, max_shrink=0.5, scale_dtype=torch.float32, damp=0.0)
    assert torch.equal(search_clip(w, acc.gram, sch, grid=10, max_shrink=0.5, scale_dtype=torch.float32,
                                   damp=1e6), free)
    # and the data move it without the ridge: the test would pass vacuously if they never did
    assert not torch.equal(search_clip(w, acc.gram, sch, grid=10, max_shrink=0.5, scale_dtype=torch.float32,
                                       damp=0.0), free)
