"""GPTQ on GGUF grids: the bytes still decode (in the gguf package) to exactly the weights GPTQ settled on,
every code stays on the grid RTN's scales made, and the output error tr((W - Q) H (W - Q)ᵀ), computed in
float64, is below RTN's on the same type."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as ref_dequantize

from quantkit.errors import UserError
from quantkit.formats.gguf_codec import decode, encode
from quantkit.solvers.gguf_gptq import gguf_gptq


def _problem(out=32, n=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(n, n, generator=g, dtype=torch.float64) / n ** 0.5
    X = torch.randn(4 * n, n, generator=g, dtype=torch.float64) @ (torch.eye(n, dtype=torch.float64) + 3 * mix)
    H = 2 * X.T @ X / X.shape[0]
    return (torch.randn(out, n, generator=g) * 0.02), H


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_gptq_on_the_grid_beats_rtn_and_decodes_exactly(name):
    w, H = _problem()
    blocks, raw = gguf_gptq(w, H.float(), name)
    ours = decode(blocks, w.shape)
    theirs = ref_dequantize(raw, T[name]).astype(np.float32)
    assert np.array_equal(ours.numpy().view(np.uint32), theirs.view(np.uint32))
    rtn = decode(encode(w, name, importance=H.diagonal().float())[0], w.shape)
    err = lambda q: float(torch.einsum("oi,ij,oj->", (w - q).double(), H, (w - q).double()))
    assert err(ours) < 0.97 * err(rtn), (err(ours), err(rtn))
    assert torch.equal(blocks.d, encode(w, name, importance=H.diagonal().float())[0].d)  # the same grid


def test_iq4_nl_is_refused():
    w, H = _problem(out=4, n=64)
    with pytest.raises(UserError, match="IQ4_NL"):
        gguf_gptq(w, H.float(), "IQ4_NL")
