"""A checkpoint's tensors checked against what its config implies, and for values no solver writes, before the
first forward. Every loader goes through here (runtime/loader.py is the one reader of checkpoints).

Layout: each stored tensor's shape and dtype must be what the module built from config.json expects (the
caller passes that module's state dict), else loading fails with a size-mismatch traceback or, where a shape
happens to fit, computes garbage. Values: float tensors must be finite and scales non-zero. quantkit floors
every stored scale above zero (solvers/rtn.scale_floor, the FP4 and FP8 grids), input and KV scales divide the
activations, and one NaN in a scale made generate print an empty completion and serve answer 500s; so a
non-finite or zero value means the file was damaged after it was written.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..errors import UserError

REDO = "copy the checkpoint again or re-run quantkit quantize"
SCALE_SUFFIXES = ("weight_scale", "input_scale", "k_scale", "v_scale", "weight_global_scale",
                  "input_global_scale")
_E4M3_NAN = 0x7F  # float8_e4m3fn has no infinities; NaN is S.1111.111


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _fmt(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _castable(dtype: torch.dtype) -> bool:
    """Float tensors of two bytes or more are cast to the dtype the model is served in, so any such is fine."""
    return dtype.is_floating_point and torch.tensor([], dtype=dtype).element_size() > 1


def _dtype_fits(found: torch.dtype, want: torch.dtype) -> bool:
    return found == want or (_castable(want) and _castable(found))


def check_layout(path: Path, stored: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                 implied_by: dict[str, str]) -> None:
    """UserError for the first tensor of STORED whose shape or dtype differs from EXPECTED's tensor of that name
    (the empty module config.json builds). implied_by: {module name: what in config.json sets its layout}."""
    for name, want in expected.items():
        got = stored.get(name)
        if got is None:
            continue  # missing or tied: the caller's load report names it
        if tuple(got.shape) != tuple(want.shape) or not _dtype_fits(got.dtype, want.dtype):
            what = "float" if _castable(want.dtype) else _dtype_name(want.dtype)
            source = implied_by.get(name.rpartition(".")[0], "its architecture")
            raise UserError(f"'{path}': tensor {name} is {_dtype_name(got.dtype)} {_fmt(got.shape)} but config.json "
                            f"({source}) implies {what} {_fmt(want.shape)}; {REDO}")
        if name.endswith(".weight_shape") and not want.is_meta and not torch.equal(got, want.to(got.dtype)):
            raise UserError(f"'{path}': tensor {name} records shape {got.tolist()} but the model's Linear is "
                            f"{want.tolist()}; {REDO}")
    _check_g_idx(path, stored)


def _check_g_idx(path: Path, stored: dict[str, torch.Tensor]) -> None:
    """Act-order group indices must name groups that exist: one out of range reads another row's scales."""
    for name, g_idx in stored.items():
        scale = stored.get(name.replace(".weight_g_idx", ".weight_scale"))
        if not name.endswith(".weight_g_idx") or scale is None or g_idx.numel() == 0:
            continue
        lo, hi = int(g_idx.min()), int(g_idx.max())
        if lo < 0 or hi >= scale.shape[-1]:
            raise UserError(f"'{path}': tensor {name} holds group indices {lo}..{hi} but there are "
                            f"{scale.shape[-1]} groups; {REDO}")


def _first(mask: torch.Tensor) -> list[int]:
    return [int(i) for i in mask.nonzero()[0]]


def _bad_values(t: torch.Tensor) -> torch.Tensor | None:
    """Where T is NaN or infinite; None for tensors that cannot hold either."""
    if not t.is_floating_point():
        return None
    if t.element_size() == 1:
        if t.dtype != torch.float8_e4m3fn:
            return None  # e5m2 codes are never written; E8M0 exponents are uint8
        return (t.view(torch.uint8) & 0x7F) == _E4M3_NAN
    return ~torch.isfinite(t)


def check_values(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """UserError naming the first tensor with a NaN or infinity, or a scale that is zero."""
    for name, t in tensors.items():
        bad = _bad_values(t)
        if bad is not None and bool(bad.any()):
            at = _first(bad)
            raise UserError(f"'{path}': tensor {name} holds {int(bad.sum())} non-finite value(s) (first "
                            f"{t[tuple(at)].float().item()} at {at}); expected finite numbers, so the file is "
                            f"damaged; {REDO}")
        if name.endswith(SCALE_SUFFIXES) and t.is_floating_point():
            zero = t.float() == 0
            if bool(zero.any()):
                raise UserError(f"'{path}': tensor {name} holds {int(zero.sum())} zero scale(s) (first at "
                                f"{_first(zero)}); expected non-zero scales, which every solver writes, so the file "
                                f"is damaged; {REDO}")
