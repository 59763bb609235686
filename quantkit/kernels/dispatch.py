"""Which kernel runs a quantised Linear: by device and row count, forced with QUANTKIT_KERNEL.

CUDA: the CUDA C++ GEMV at 1-4 rows (4-bit, fp16/bf16), the Triton kernels up to TRITON_GEMM_MAX_ROWS rows,
dequantise + cuBLAS above. CPU: torch's packed int4/int8 ops where they apply (one-time repack in prepare),
else dequantise into a reused buffer + float matmul. In torch 2.13 those ops are only vectorised for bfloat16
activations (fp32/fp16 take a scalar path 100-300x slower than a float matmul, bench/kernels_cpu.py), so
they are repacked for bfloat16 models (scale dtype) and used for bfloat16 activations only. Triton is only chosen on CPU when forced (interpreter).
QUANTKIT_KERNEL=reference|triton|cuda|torch forces a family; `torch` means torch's own ops (CPU packed ops,
or dequantise with PyTorch + matmul on GPU). The output dtype is always x.dtype.
"""
from __future__ import annotations

import functools
import importlib.util
import logging
import os

import torch

from ..errors import UserError
from . import cpu, reference

log = logging.getLogger("quantkit.kernels")

ENV = "QUANTKIT_KERNEL"
FORCIBLE = ("reference", "triton", "cuda", "torch")
CUDA_GEMV_MAX_ROWS = 4
# Rows up to which the fused Triton GEMM beats dequantise + cuBLAS. Not yet measured on a GPU (bench/kernels.py
# prints the crossover); 64 is where a decode-bound kernel usually stops winning. Override to tune.
TRITON_GEMM_MAX_ROWS = int(os.environ.get("QUANTKIT_TRITON_MAX_ROWS", "64"))

_logged: set = set()


def forced_kernel() -> str | None:
    value = os.environ.get(ENV, "").strip().lower()
    if not value or value == "auto":
        return None
    if value not in FORCIBLE:
        raise UserError(f"{ENV}={value!r} is not a kernel; use one of {', '.join(FORCIBLE)} or unset it")
    return value


@functools.lru_cache(maxsize=1)
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_usable(device: torch.device) -> bool:
    if not triton_installed():
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=1)
def cuda_ready() -> bool:
    """True once the CUDA extension is built and importable; False (logged once) on CPU or a failed build."""
    if not torch.cuda.is_available():
        return False
    try:
        from . import cuda as qk_cuda

        qk_cuda.load()
        return True
    except Exception as e:  # a broken toolchain must not take the model down: the Triton/torch paths remain
        log.warning("CUDA kernels unavailable, using Triton/PyTorch paths: %s", e)
        return False


def _tensors(module):
    return (module.weight_packed, module.weight_scale, getattr(module, "weight_zero_point", None),
            getattr(module, "weight_g_idx", None), module.group_size)


def prepare(module) -> None:
    """One-time work per layer at load: CPU repacks for torch's packed ops, cached on the module."""
    module._cpu_int4 = None
    module._cpu_int8 = None
    if module.weight_packed.device.type == "cpu" and (module.weight_scale.dtype == torch.bfloat16
                                                       or getattr(module, "cpu_bf16_activations", False)):
        wp, sc, zp, gi, gs = _tensors(module)
        if module.bits == 4:
            module._cpu_int4 = cpu.repack_int4(wp, sc, zp, gi, gs, module.in_features)
        elif module.bits == 8:
            module._cpu_int8 = cpu.repack_int8(wp, sc, zp, module.in_features)
    module._qk_prepared = True


def choose(module, rows: int, x: torch.Tensor) -> str:
    forced = forced_kernel()
    dev = x.device
    gi_present = getattr(module, "weight_g_idx", None) is not None
    if forced == "reference":
        return "reference"
    if forced == "triton":
        if not triton_usable(dev):
            raise UserError(f"{ENV}=triton needs triton and a CUDA tensor (or TRITON_INTERPRET=1 on CPU); "
                            f"got a {dev.type} tensor; unset {ENV}")
        return "triton-gemv" if rows <= CUDA_GEMV_MAX_ROWS else "triton-gemm"
    if forced == "cuda":
        if dev.type != "cuda" or not cuda_ready():
            raise UserError(f"{ENV}=cuda needs a CUDA GPU with the quantkit CUDA kernels built; unset {ENV}")
        from .cuda import gemv_supported

        ok = gemv_supported(module.in_features, module.group_size, gi_present, module.bits, rows, x.dtype)
        return "cuda-gemv" if ok else "cuda-dequant-matmul"
    if dev.type == "cpu":
        # fp32/fp16 activations take the packed ops only when the loader opted in (runtime): they then run in
        # bf16, ~4e-3 relative error per product, far below W4's own error, for a 50-200x faster layer
        packed_ok = x.dtype == torch.bfloat16 or getattr(module, "cpu_bf16_activations", False)
        if packed_ok and module._cpu_int4 is not None:
            return "cpu-int4pack"
        if packed_ok and module._cpu_int8 is not None:
            return "cpu-int8pack"
        return "torch-dequant-matmul"
    if forced == "torch":
        return "torch-dequant-matmul"
    if rows <= CUDA_GEMV_MAX_ROWS and cuda_ready():
        from .cuda import gemv_supported

        if gemv_supported(module.in_features, module.group_size, gi_present, module.bits, rows, x.dtype):
            return "cuda-gemv"
    if triton_usable(dev):
        if rows <= CUDA_GEMV_MAX_ROWS:
            return "triton-gemv"
        if rows <= TRITON_GEMM_MAX_ROWS:
            return "triton-gemm"
        return "triton-dequant-matmul"
    if cuda_ready():
        return "cuda-dequant-matmul"
    return "torch-dequant-matmul"


def _log_once(module, path: str, rows: int, x: torch.Tensor):
    key = (path, x.device.type, x.dtype, module.bits, module.group_size, module.out_features, module.in_features)
    if key not in _logged:
        _logged.add(key)
        log.info("kernel %s for %s %dx%d w%d g%d %s (first seen at %d rows)", path, x.device.type,
                 module.out_features, module.in_features, module.bits, module.group_size,
                 str(x.dtype).replace("torch.", ""), rows)


def _dequant_matmul(module, x2: torch.Tensor, path: str) -> torch.Tensor:
    wp, sc, zp, gi, gs = _tensors(module)
    n, k = module.out_features, module.in_features
    buf = cpu.weight_buffer(n, k, x2.dtype, x2.device)
    if path == "triton-dequant-matmul":
        from .triton import dequantize_int

        dequantize_int(wp, sc, zp, gi, gs, module.bits, k, out=buf)
    elif path == "cuda-dequant-matmul":
        from .cuda import dequantize_int

        dequantize_int(wp, sc, zp, gi, gs, module.bits, k, out=buf)
    else:
        cpu.dequantize_into(buf, wp, sc, zp, gi, gs, module.bits)
    bias = module.bias
    if bias is None:
        return x2 @ buf.t()
    return torch.addmm(bias.to(x2.dtype), x2, buf.t())


def linear_forward(module, x: torch.Tensor) -> torch.Tensor:
    """y = x @ W^T + b for a QuantLinear, in x.dtype, by the kernel `choose` picks for this device and size."""
    cpu.check_activation(x)
    if not getattr(module, "_qk_prepared", False):
        prepare(module)
    k = module.in_features
    if x.shape[-1] != k:
        raise UserError(f"quantised Linear expects {k} input features, got {x.shape[-1]}")
    x2 = x.reshape(-1, k)
    rows = x2.shape[0]
    path = choose(module, rows, x)
    _log_once(module, path, rows, x)
    wp, sc, zp, gi, gs = _tensors(module)
    bias = module.bias
    if path == "reference":
        y = reference.matmul(x2, wp, sc, zp, gi, gs, module.bits, k, bias).to(x.dtype)
    elif path in ("triton-gemv", "triton-gemm"):
        from .triton import wna16_matmul

        y = wna16_matmul(x2, wp, sc, zp, gi, gs, module.bits, bias, variant=path.split("-")[1])
    elif path == "cuda-gemv":
        from .cuda import gemv_w4a16

        y = gemv_w4a16(x2, wp, sc, zp, gi, gs, bias)
    elif path in ("cpu-int4pack", "cpu-int8pack"):
        xb = x2.to(torch.bfloat16)
        y = cpu.int4_matmul(module._cpu_int4, xb) if path == "cpu-int4pack" else cpu.int8_matmul(module._cpu_int8, xb)
        if bias is not None:
            y = y + bias.to(y.dtype)
        y = y.to(x.dtype)
    else:
        y = _dequant_matmul(module, x2, path)
    return y.reshape(*x.shape[:-1], module.out_features)
