"""The one table of dtype names users type (--dtype, recipes, `quantkit.load(dtype=...)`) and torch's dtypes.

Every layer that reads a dtype name reads it here, so a name accepted by one command is accepted by all.
"""
from __future__ import annotations

import torch

from .errors import UserError

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# 'auto': the dtype the checkpoint or model stores; the caller decides what that is
AUTO = "auto"


def parse_dtype(name) -> torch.dtype | None:
    """A dtype name to a torch dtype, 'auto' and None to None; torch dtypes pass through."""
    if name is None or isinstance(name, torch.dtype):
        return name
    if name == AUTO:
        return None
    if name not in DTYPES:
        raise UserError(f"unknown dtype '{name}'; choose one of: {', '.join([*DTYPES, AUTO])}")
    return DTYPES[name]


def stored_dtype(name) -> torch.dtype:
    """A dtype as config.json writes it ('bfloat16', 'torch.float16', None): float32 when unknown or absent."""
    return DTYPES.get(str(name).replace("torch.", ""), torch.float32)
