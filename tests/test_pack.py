"""Packing: round trips over random shapes/values, and the exact bit layout compressed-tensors defines."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantkit.formats.pack import pack_int32, unpack_int32


def _codes(bits, rows, cols, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (rows, cols), generator=g).to(torch.int8)


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from([4, 8]), rows=st.integers(1, 9), words=st.integers(1, 6), extra=st.integers(0, 7),
       seed=st.integers(0, 2**31 - 1), dim=st.sampled_from([0, 1]))
def test_round_trip(bits, rows, words, extra, seed, dim):
    per = 32 // bits
    cols = words * per - (extra % per)  # includes lengths that do not fill the last word
    q = _codes(bits, rows, cols, seed)
    if dim == 0:
        q = q.t().contiguous()
    packed = pack_int32(q, bits, dim=dim)
    assert packed.dtype == torch.int32
    n = q.shape[dim]
    assert packed.shape[dim] == -(-n // per)
    assert torch.equal(unpack_int32(packed, bits, n, dim=dim), q)


@settings(max_examples=40, deadline=None)
@given(bits=st.sampled_from([4, 8]), seed=st.integers(0, 2**31 - 1))
def test_bit_layout_matches_format(bits, seed):
    # Independent reading of the published layout: element i of a row at bit offset (i % per) * bits of word
    # i // per, stored unsigned as q + 2^(bits-1), least significant first.
    per = 32 // bits
    q = _codes(bits, 3, per * 4, seed)
    packed = pack_int32(q, bits)
    for r in range(3):
        for i in range(q.shape[1]):
            word = int(packed[r, i // per]) & 0xFFFFFFFF
            field = (word >> ((i % per) * bits)) & ((1 << bits) - 1)
            assert field == int(q[r, i]) + (1 << (bits - 1))


def test_extremes_and_sign_offset():
    q = torch.tensor([[-8, 7, 0, -1, 1, -8, 7, 3]], dtype=torch.int8)
    packed = pack_int32(q, 4)
    # unsigned nibbles 0,15,8,7,9,0,15,11 -> 0xBF0978F0 as int32
    assert int(packed[0, 0]) & 0xFFFFFFFF == 0xBF0978F0
    assert torch.equal(unpack_int32(packed, 4, 8), q)
