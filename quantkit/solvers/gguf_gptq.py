"""GPTQ on a GGUF block grid. Each block's scales (for the k-quants: the super-block scale and the quantised
sub-block scales and minimums) are fixed first by the encoder's own search on the original weights, with the
Hessian's diagonal as per-column importance; GPTQ's column loop (solvers/gptq.py) then codes column after
column to the nearest level of that fixed grid and pushes each column's error onto the columns not yet coded.
The codes it settles on are written into the same block record, so the bytes decode (in llama.cpp or
`gguf_blocks.dequantize`) to exactly the weights the loop produced. IQ4_NL's non-uniform levels are not
supported here."""
from __future__ import annotations

import torch

from ..errors import UserError
from ..formats.gguf_blocks import Blocks, sub_steps
from ..formats.gguf_codec import encode
from ..formats.gguf_pack import pack
from .gptq import _column_loop, _order
from .gptq_factor import drop_dead_channels, factor


def _steps(b: Blocks, out: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per weight (out, n): the step and low of its grid (value = step * level - low), as dequantize forms them,
    so the loop's values are the decoded ones bit for bit."""
    step, low = sub_steps(b)
    spread = lambda t: t.expand(-1, -1, b.kind.sub).reshape(out, n)
    return spread(step), spread(low)


class BlockGrid:
    """The grid `_column_loop` rounds onto: every column's step/offset fixed up front (no group is refitted)."""

    def __init__(self, blocks: Blocks, out: int, n: int):
        self.blocks = blocks
        step, low = _steps(blocks, out, n)
        self.step_t, self.low_t = step.t().contiguous(), low.t().contiguous()
        self.lo, self.hi = -blocks.kind.offset, blocks.kind.levels - 1 - blocks.kind.offset
        if blocks.kind.name == "Q8_0":
            self.lo, self.hi = -128, 127
        self.codes_t = torch.zeros(n, out, dtype=torch.int16)

    def round(self, pos: int, row: torch.Tensor, g: int, out: torch.Tensor) -> torch.Tensor:
        step, low = self.step_t[pos], self.low_t[pos]
        safe = torch.where(step == 0, torch.ones_like(step), step)
        level = torch.where(step == 0, torch.zeros_like(row), torch.round((row + low) / safe)).clamp(self.lo, self.hi)
        self.codes_t[pos] = level.to(torch.int16)
        return torch.sub(step * level, low, out=out)


def gguf_gptq(w: torch.Tensor, H: torch.Tensor, type_name: str, damp: float = 0.01, block_size: int = 128):
    """(Blocks, bytes) for w (out, n) given its inputs' Hessian H (n, n), columns in their own order."""
    if type_name == "IQ4_NL":
        raise UserError("GPTQ does not run on IQ4_NL's non-uniform grid; use rtn for it")
    W, Hp = w.detach().float().clone(), H.detach().float().clone()
    drop_dead_channels(W, Hp)
    blocks, _ = encode(W, type_name, importance=Hp.diagonal().clamp_min(0))
    out, n = W.shape
    U, _used = factor(Hp, damp, "<gguf>")
    if U is None:  # not positive definite even damped: the RTN blocks stand
        return blocks, pack(blocks).reshape(out, -1)
    grid = BlockGrid(blocks, out, n)
    order = _order(Hp, None, blocks.kind.block)
    _column_loop(W.t().contiguous(), U, grid, order, [True] * (n // blocks.kind.block), Hp.diagonal(), block_size)
    codes = grid.codes_t.t().reshape(blocks.q.shape) + blocks.kind.offset
    solved = Blocks(blocks.kind, blocks.d, codes.to(torch.int16), blocks.sc, blocks.dmin, blocks.mn)
    return solved, pack(solved).reshape(out, -1)
