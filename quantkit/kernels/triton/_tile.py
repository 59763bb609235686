"""One dequantised weight tile, shared by the dequant, GEMV and GEMM kernels so they cannot disagree.

The tile is k-major, [BLOCK_K, BLOCK_N], in float32: w = scale * (u - zero_u), with u the stored unsigned code
and zero_u the stored unsigned zero point (both carry the same 2^(bits-1) offset, which cancels), or
w = scale * (u - 2^(bits-1)) when symmetric. Each int32 word is loaded once and split into its PER codes.
"""
import triton
import triton.language as tl


@triton.jit
def dequant_tile(wp_ptr, s_ptr, zp_ptr, gidx_ptr, offs_n, k0, N, K, KW, G, GROUP_SPAN,
                 BITS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                 HAS_ZP: tl.constexpr, HAS_GIDX: tl.constexpr, PER_K_GROUP: tl.constexpr):
    PER: tl.constexpr = 32 // BITS
    BKW: tl.constexpr = BLOCK_K // PER
    MASK: tl.constexpr = (1 << BITS) - 1
    n_ok = offs_n < N
    rows = offs_n.to(tl.int64)
    offs_w = k0 // PER + tl.arange(0, BKW)
    words = tl.load(wp_ptr + rows[None, :] * KW + offs_w[:, None],
                    mask=(offs_w[:, None] < KW) & n_ok[None, :], other=0)
    shifts = tl.arange(0, PER) * BITS
    # arithmetic shift drags the sign bit along; the mask keeps only this code's bits
    u = (words[:, None, :] >> shifts[None, :, None]) & MASK
    u = tl.reshape(u, (BLOCK_K, BLOCK_N)).to(tl.float32)
    if PER_K_GROUP:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        if HAS_GIDX:
            g = tl.load(gidx_ptr + offs_k, mask=k_ok, other=0)
        else:
            g = offs_k // GROUP_SPAN
        # columns past K would look up a group >= G (past the scale tensor): mask them, their weight is 0
        sz_ok = k_ok[:, None] & n_ok[None, :]
        s = tl.load(s_ptr + rows[None, :] * G + g[:, None], mask=sz_ok, other=0.0).to(tl.float32)
        if HAS_ZP:
            zw = tl.load(zp_ptr + (offs_n // PER)[None, :] * G + g[:, None], mask=sz_ok, other=0)
            z = ((zw >> ((offs_n % PER) * BITS)[None, :]) & MASK).to(tl.float32)
            w = (u - z) * s
        else:
            w = (u - (1 << (BITS - 1))) * s
    else:
        g = k0 // GROUP_SPAN
        s = tl.load(s_ptr + rows * G + g, mask=n_ok, other=0.0).to(tl.float32)
        if HAS_ZP:
            zw = tl.load(zp_ptr + (offs_n // PER) * G + g, mask=n_ok, other=0)
            z = ((zw >> ((offs_n % PER) * BITS)) & MASK).to(tl.float32)
            w = (u - z[None, :]) * s[None, :]
        else:
            w = (u - (1 << (BITS - 1))) * s[None, :]
    return w
