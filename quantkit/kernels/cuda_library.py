"""The `quantkit::` CUDA ops as torch sees them: their schemas, fake (meta) implementations, argument checks and
the one-time JIT build that registers the CUDA implementations (kernels/cuda/binding.cpp, TORCH_LIBRARY).

This module imports without a GPU, so the fakes and checks are tested on a CPU: there `define_schemas()` declares
the same schemas from Python (no implementation behind them), which is enough for FakeTensorMode and
torch.compile to trace through the ops. Where the extension loads, its TORCH_LIBRARY block declares them instead
(a namespace can be declared once per process), and the fakes are registered on top.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from ..errors import UserError

NAMESPACE = "quantkit"
# The schemas exactly as binding.cpp's TORCH_LIBRARY block spells them (tests/test_kernels_cuda_ops.py compares)
SCHEMAS = {
    "gemv_w4a16": "gemv_w4a16(Tensor x, Tensor weight_packed, Tensor weight_scale, Tensor? weight_zero_point, "
                  "Tensor? g_idx, Tensor? bias, int group_size) -> Tensor",
    "dequant_int": "dequant_int(Tensor weight_packed, Tensor weight_scale, Tensor? weight_zero_point, "
                   "Tensor? g_idx, int bits, int group_size, int in_features, ScalarType dtype) -> Tensor",
    "dequant_int_out": "dequant_int_out(Tensor weight_packed, Tensor weight_scale, Tensor? weight_zero_point, "
                       "Tensor? g_idx, int bits, int group_size, Tensor(a!) out) -> ()",
    "dequant_fp8": "dequant_fp8(Tensor weight, Tensor weight_scale, ScalarType dtype) -> Tensor",
    "gemm_w4a16_tc": "gemm_w4a16_tc(Tensor x, Tensor weight_packed, Tensor weight_scale, Tensor? weight_zero_point, "
                     "Tensor? bias, int group_size) -> Tensor",
}
SOURCES = ("binding.cpp", "dequant.cu", "gemv_w4a16.cu", "gemm_w4a16_tc.cu")
SOURCE_DIR = Path(__file__).parent / "cuda"
GEMV_MAX_ROWS = 4
TC_MAX_ROWS = 64
HALF_DTYPES = (torch.float16, torch.bfloat16)
OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
VECTOR_LOADED = ("x", "weight_packed")  # read with 16-byte loads by the GEMV

_python_library = None  # the Library object that declared the schemas on a machine without the extension


def defined() -> bool:
    return hasattr(torch.ops, NAMESPACE) and hasattr(getattr(torch.ops, NAMESPACE), "gemv_w4a16")


def define_schemas() -> None:
    """Declare the ops from Python where the extension is not loaded (CPU machines), then register the fakes."""
    global _python_library
    if not defined():
        _python_library = torch.library.Library(NAMESPACE, "DEF")
        for schema in SCHEMAS.values():
            _python_library.define(schema)
    register_fakes()


@functools.lru_cache(maxsize=1)
def load_extension() -> None:
    """Build (first call: about a minute, then cached by torch in TORCH_EXTENSIONS_DIR) and load the library whose
    TORCH_LIBRARY block registers the CUDA implementations; then the fakes. Raises if no GPU or the build fails."""
    if not torch.cuda.is_available():
        raise UserError("the quantkit CUDA kernels need a CUDA GPU and a CUDA build of torch; "
                        f"torch {torch.__version__} sees none; use the CPU or Triton paths")
    if _python_library is not None:
        raise RuntimeError("quantkit ops were declared from Python in this process; the extension cannot load")
    from torch.utils.cpp_extension import load as jit_load

    jit_load(name="quantkit_cuda_ops", sources=[str(SOURCE_DIR / s) for s in SOURCES], is_python_module=False,
             extra_cflags=["-O3"], extra_cuda_cflags=["-O3", "-lineinfo"],
             verbose=os.environ.get("QUANTKIT_CUDA_VERBOSE") == "1")
    register_fakes()


@functools.lru_cache(maxsize=1)
def register_fakes() -> None:
    torch.library.register_fake(f"{NAMESPACE}::gemv_w4a16")(_gemv_fake)
    torch.library.register_fake(f"{NAMESPACE}::dequant_int")(_dequant_int_fake)
    torch.library.register_fake(f"{NAMESPACE}::dequant_int_out")(_dequant_int_out_fake)
    torch.library.register_fake(f"{NAMESPACE}::dequant_fp8")(_dequant_fp8_fake)
    torch.library.register_fake(f"{NAMESPACE}::gemm_w4a16_tc")(_tc_fake)


def gemv_supported(in_features: int, group_size: int, g_idx_present: bool, bits: int, rows: int,
                   dtype: torch.dtype) -> bool:
    """The GEMV's preconditions: 4 bits, 1-4 half/bf16 rows, K % 32 == 0 (16-byte loads), groups of 8n codes."""
    return (bits == 4 and 1 <= rows <= GEMV_MAX_ROWS and dtype in HALF_DTYPES and in_features % 32 == 0
            and (group_size <= 0 or group_size % 8 == 0 or g_idx_present))


def tc_supported(in_features: int, group_size: int, g_idx_present: bool, bits: int, rows: int,
                 dtype: torch.dtype) -> bool:
    """The tensor-core GEMM's preconditions: 4 bits, 1-64 half/bf16 rows, K % 32 == 0, groups of 32n, no g_idx."""
    return (bits == 4 and 1 <= rows <= TC_MAX_ROWS and dtype in HALF_DTYPES and in_features % 32 == 0
            and not g_idx_present and (group_size <= 0 or group_size % 32 == 0))


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise UserError(f"quantkit CUDA op: {message}")


def _without_storage(t: torch.Tensor) -> bool:
    """Fake and meta tensors (tracing, torch.compile) have shapes but no address to check."""
    from torch._subclasses.fake_tensor import is_fake

    return t.device.type == "meta" or is_fake(t)


def _check_common(named: dict, cuda: bool) -> None:
    present = {k: t for k, t in named.items() if t is not None}
    devices = {t.device for t in present.values()}
    _need(len(devices) == 1, f"inputs are on different devices {sorted(map(str, devices))}; move them to one")
    if cuda:
        _need(next(iter(devices)).type == "cuda", f"inputs are on {next(iter(devices))}; these kernels run on CUDA "
              "tensors only (move the model with --device cuda, or use the CPU paths)")
    for name, t in present.items():
        _need(t.is_contiguous(), f"{name} must be contiguous (make it so once at load, not per call)")
    for name in VECTOR_LOADED:
        t = present.get(name)
        if t is not None and not _without_storage(t):
            _need(t.data_ptr() % 16 == 0, f"{name} must start on a 16-byte boundary (the kernels load it 16 bytes "
                  "at a time); pass a tensor that is not an offset view")
    for name in ("weight_packed", "weight_zero_point", "g_idx"):
        t = present.get(name)
        _need(t is None or t.dtype == torch.int32, f"{name} must be int32, got {t.dtype if t is not None else None}")


def check_gemv(x, weight_packed, weight_scale, weight_zero_point, g_idx, bias, group_size, *, cuda=True,
               tensor_cores=False):
    """Raise UserError naming the first argument the GEMV (or, with tensor_cores, the tensor-core GEMM) cannot
    take; metadata only (no sync, no copy)."""
    _check_common({"x": x, "weight_packed": weight_packed, "scale": weight_scale,
                   "weight_zero_point": weight_zero_point, "g_idx": g_idx, "bias": bias}, cuda)
    _need(x.dim() == 2, f"x must be 2-D [rows, in_features], got shape {tuple(x.shape)}")
    m, k = x.shape
    n = weight_packed.shape[0]
    if tensor_cores:
        _need(tc_supported(k, group_size, g_idx is not None, 4, m, x.dtype),
              f"the tensor-core W4A16 GEMM takes 1-{TC_MAX_ROWS} float16/bfloat16 rows, in_features % 32 == 0, "
              f"group_size % 32 == 0 and no g_idx (got rows={m}, dtype={x.dtype}, in_features={k}, "
              f"group_size={group_size}, g_idx={g_idx is not None})")
    else:
        _need(gemv_supported(k, group_size, g_idx is not None, 4, m, x.dtype),
              f"the W4A16 GEMV takes 1-{GEMV_MAX_ROWS} float16/bfloat16 rows with in_features % 32 == 0 and "
              f"group_size % 8 == 0 (got rows={m}, dtype={x.dtype}, in_features={k}, group_size={group_size})")
    _need(weight_packed.dim() == 2 and weight_packed.shape[1] * 8 == k,
          f"weight_packed must be [out, {k // 8}] for in_features={k}, got {tuple(weight_packed.shape)}")
    _check_groups(weight_scale, weight_zero_point, g_idx, n, k, group_size, 4)
    _need(weight_scale.dtype == x.dtype, f"weight_scale must have x's dtype {x.dtype} (convert it once at load), "
          f"got {weight_scale.dtype}")
    _need(bias is None or (bias.dtype == x.dtype and tuple(bias.shape) == (n,)), f"bias must be [{n}] in {x.dtype}")


def _check_groups(scale, zero, g_idx, n, k, group_size, bits):
    groups = scale.shape[1] if scale.dim() == 2 else 1
    _need(scale.shape[0] == n if scale.dim() == 2 else scale.numel() == n,
          f"weight_scale must have {n} rows (one per output), got {tuple(scale.shape)}")
    if g_idx is not None:
        _need(g_idx.numel() == k, f"g_idx must have in_features={k} entries, got {g_idx.numel()}")
    elif group_size > 0:
        _need(groups == -(-k // group_size), f"group_size={group_size} over in_features={k} needs "
              f"{-(-k // group_size)} scale columns, weight_scale has {groups}")
    per = 32 // bits
    _need(zero is None or tuple(zero.shape) == (-(-n // per), groups),
          f"weight_zero_point must be packed along dim 0 as [{-(-n // per)}, {groups}], got "
          f"{tuple(zero.shape) if zero is not None else None}")


def check_dequant_int(weight_packed, weight_scale, weight_zero_point, g_idx, bits, group_size, out, *, cuda=True):
    _check_common({"weight_packed": weight_packed, "scale": weight_scale, "weight_zero_point": weight_zero_point,
                   "g_idx": g_idx, "out": out}, cuda)
    _need(bits in (4, 8), f"bits must be 4 or 8, got {bits}")
    n, k = out.shape
    _need(weight_packed.dim() == 2 and weight_packed.shape == (n, -(-k // (32 // bits))),
          f"weight_packed must be [{n}, {-(-k // (32 // bits))}] for a [{n}, {k}] output, got "
          f"{tuple(weight_packed.shape)}")
    _need(out.dtype in OUT_DTYPES and weight_scale.dtype == out.dtype,
          f"weight_scale must have the output dtype {out.dtype} (one of float16, bfloat16, float32), "
          f"got {weight_scale.dtype}")
    _check_groups(weight_scale, weight_zero_point, g_idx, n, k, group_size, bits)


def _gemv_fake(x, weight_packed, weight_scale, weight_zero_point, g_idx, bias, group_size):
    check_gemv(x, weight_packed, weight_scale, weight_zero_point, g_idx, bias, group_size, cuda=False)
    return x.new_empty(x.shape[0], weight_packed.shape[0])


def _tc_fake(x, weight_packed, weight_scale, weight_zero_point, bias, group_size):
    check_gemv(x, weight_packed, weight_scale, weight_zero_point, None, bias, group_size, cuda=False,
               tensor_cores=True)
    return x.new_empty(x.shape[0], weight_packed.shape[0])


def _dequant_int_fake(weight_packed, weight_scale, weight_zero_point, g_idx, bits, group_size, in_features, dtype):
    out = weight_packed.new_empty(weight_packed.shape[0], in_features, dtype=dtype)
    check_dequant_int(weight_packed, weight_scale, weight_zero_point, g_idx, bits, group_size, out, cuda=False)
    return out


def _dequant_int_out_fake(weight_packed, weight_scale, weight_zero_point, g_idx, bits, group_size, out):
    check_dequant_int(weight_packed, weight_scale, weight_zero_point, g_idx, bits, group_size, out, cuda=False)


def _dequant_fp8_fake(weight, weight_scale, dtype):
    return weight.new_empty(weight.shape, dtype=dtype)
