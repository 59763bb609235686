"""Triton reads nothing past the scale tensor: group sizes that are not a multiple of the K tile (48, 96)
without g_idx make a tile span several groups, and its columns past K must not look up a group >= G.

The interpreter does not fault on an out-of-bounds read, so the scales sit at the start of a larger buffer
whose tail is NaN: any read past them turns the output into NaN.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere: no GPU here

import pytest  # noqa: E402
import torch  # noqa: E402

from quantkit.kernels.triton import wna16_matmul  # noqa: E402
from quantkit.testing.packed import make_packed  # noqa: E402


def _nan_tailed(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of t whose storage continues with poison for another tile's worth of elements: NaN for
    scales; all bits set for packed int32 zero points (only the scales' NaN can show in the output)."""
    poison = float("nan") if t.dtype.is_floating_point else -1
    buf = torch.full((t.numel() + 4096,), poison, dtype=t.dtype)
    view = buf[:t.numel()].view(t.shape)
    view.copy_(t)
    assert view.is_contiguous() and view.data_ptr() == buf.data_ptr()
    return view


# K a multiple of the group but not of the 64 (gemm) / 128 (gemv) K tile, so the last tile runs past K
@pytest.mark.parametrize("group_size,k", [(48, 96), (48, 144), (96, 192), (96, 288)])
@pytest.mark.parametrize("variant,rows,dtype", [("gemv", 1, torch.float32), ("gemv", 4, torch.float16),
                                                ("gemm", 7, torch.float32)])
@pytest.mark.parametrize("symmetric", [True, False])
def test_scales_are_not_read_past_their_end(group_size, k, variant, rows, dtype, symmetric):
    p = make_packed(24, k, 4, group_size, symmetric, seed=k + rows)
    scale = _nan_tailed(p.weight_scale)
    zp = None if p.weight_zero_point is None else _nan_tailed(p.weight_zero_point)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
    y = wna16_matmul(x, p.weight_packed, scale, zp, None, group_size, 4, variant=variant)
    assert not torch.isnan(y).any(), "a scale past the tensor's end was read"
    truth = x.double() @ p.w64.t()
    # fp16: output rounding (2^-11) plus fp16 weights in the dot; fp32: accumulation order only
    tol = 3e-3 if dtype == torch.float16 else 2e-5
    assert (y.double() - truth).abs().max() <= tol * truth.abs().max()
