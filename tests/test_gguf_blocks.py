"""GGUF block encodings against the `gguf` package's own dequantisation (an independent implementation of
llama.cpp's): our bytes decode there to exactly our floats, and our codes beat its quantiser's error."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as ref_dequantize
from gguf.quants import quantize as ref_quantize

from quantkit.errors import UserError
from quantkit.formats.gguf_blocks import TYPES
from quantkit.formats.gguf_codec import decode, encode


def _weight(rows=16, cols=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    w[1] = 0                                    # an all-zero block: scale 0 must decode to zeros, not NaN
    w[2] = w[2].abs() + 0.01                    # all positive: the affine types' minimum is clamped
    w[3, :64] *= 40                             # an outlier-heavy block
    w[4] = torch.randint(-3, 4, (cols,), generator=g).float() * 1e-3  # exactly on a small grid
    return w


@pytest.mark.parametrize("name", sorted(TYPES))
def test_bytes_decode_in_gguf_to_our_floats_bit_for_bit(name):
    w = _weight()
    blocks, raw = encode(w, name)
    assert raw.dtype == np.uint8 and raw.shape == (16, 512 // TYPES[name].block * TYPES[name].nbytes)
    ours = decode(blocks, w.shape).numpy()
    theirs = ref_dequantize(raw, T[name]).astype(np.float32)
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))
    assert np.isfinite(ours).all() and not ours[1].any()


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
@pytest.mark.parametrize("weighted", [False, True])
def test_codes_err_less_than_gguf_quantize_block_by_block(name, weighted):
    w = _weight(seed=1)
    imp = torch.rand(w.shape[1], generator=torch.Generator().manual_seed(2)) ** 2 if weighted else None
    blocks, _ = encode(w, name, importance=imp)
    ref = ref_dequantize(ref_quantize(w.numpy(), T[name]), T[name]).astype(np.float64)
    k = TYPES[name].block
    wt = np.ones(w.shape) if imp is None else np.broadcast_to(imp.numpy().astype(np.float64), w.shape)
    x = w.numpy().astype(np.float64)
    ours = decode(blocks, w.shape).numpy().astype(np.float64)
    e_ours = (wt * (x - ours) ** 2).reshape(-1, k).sum(1)
    e_ref = (wt * (x - ref) ** 2).reshape(-1, k).sum(1)
    assert (e_ours <= e_ref * (1 + 1e-6) + 1e-18).all()
    assert e_ours.sum() < e_ref.sum()


@pytest.mark.parametrize("name", ["Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL"])
def test_kquant_error_sits_between_the_neighbouring_legacy_types(name):
    """No gguf quantiser exists for these to compare with; the float64 error of a bit-richer type must be
    lower and a bit-poorer one higher, which a wrong scale layout or code offset breaks by orders of magnitude."""
    w = torch.randn(32, 1024, generator=torch.Generator().manual_seed(3), dtype=torch.float64).float() * 0.02
    err = lambda n: float(((decode(encode(w, n)[0], w.shape).double() - w.double()) ** 2).sum())
    below, above = {"Q3_K": ("Q4_0", None), "Q4_K": ("Q5_0", "Q3_K"), "Q5_K": ("Q8_0", "Q4_1"),
                    "Q6_K": ("Q8_0", "Q5_1"), "IQ4_NL": ("Q5_0", "Q3_K")}[name]
    assert err(name) < (err(above) if above else float("inf"))
    assert err(below) < err(name)


def test_a_row_the_block_does_not_divide_is_a_user_error():
    with pytest.raises(UserError, match="multiple of 256"):
        encode(torch.zeros(4, 576), "Q4_K")
