"""Which kernel runs a quantised Linear: by device and row count, forced with QUANTKIT_KERNEL.

CUDA: the CUDA C++ GEMV at 1-4 rows (4-bit, fp16/bf16), the Triton kernels up to TRITON_GEMM_MAX_ROWS rows,
dequantise + cuBLAS above; the CUDA tensor-core GEMM (5-64 rows) only with QUANTKIT_KERNEL=cuda until measured.
CPU: the path the runtime measured fastest at load (use_cpu_path, kernels/path_choice.py) when it has one (the
AVX2 W4A8 op, cpu_w4a8.py, which past a few rows dequantises in C++ and multiplies in float); otherwise torch's packed int4/int8 ops where they apply (one-time repack in prepare), else dequantise into a reused buffer + float matmul. In torch 2.13 those ops are only vectorised for bfloat16
activations (fp32/fp16 take a scalar path 100-300x slower than a float matmul, bench/kernels_cpu.py), so
they are repacked for bfloat16 models (scale dtype) and used for bfloat16 activations only. Triton is only chosen on CPU when forced (interpreter).
2/3-bit weights (dense packing, codes straddle words) have no fused kernel: dequantise + matmul everywhere.
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
from . import cpu, cpu_w4a8, reference
from .cuda_library import GEMV_MAX_ROWS as CUDA_GEMV_MAX_ROWS, gemv_supported, tc_supported

log = logging.getLogger("quantkit.kernels")

ENV = "QUANTKIT_KERNEL"
FORCIBLE = ("reference", "triton", "cuda", "torch")
# Rows up to which the fused Triton GEMM beats dequantise + cuBLAS. Not yet measured on a GPU (bench/kernels_gpu.py
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
    """True once the CUDA ops are built and registered; False (logged once) on CPU or a failed build."""
    if not torch.cuda.is_available():
        return False
    try:
        from .cuda_library import load_extension

        load_extension()
        return True
    except Exception as e:  # a broken toolchain must not take the model down: the Triton/torch paths remain
        log.warning("CUDA kernels unavailable, using Triton/PyTorch paths: %s", e)
        return False


def cuda_args(module, dtype: torch.dtype):
    """The layer's tensors as the CUDA ops take them (scale and bias in the activation dtype, int32 zero points
    and g_idx, contiguous), made on the first call per dtype and kept on the module: no per-call conversion."""
    cache = module.__dict__.setdefault("_qk_cuda_args", {})
    if dtype not in cache:
        wp, sc, zp, gi, _ = _tensors(module)
        bias = module.bias
        cache[dtype] = (wp.contiguous(), sc.to(dtype).contiguous(),
                        None if zp is None else zp.to(torch.int32).contiguous(),
                        None if gi is None else gi.to(torch.int32).contiguous(),
                        None if bias is None else bias.to(dtype).contiguous())
    return cache[dtype]


def _tensors(module):
    return (module.weight_packed, module.weight_scale, getattr(module, "weight_zero_point", None),
            getattr(module, "weight_g_idx", None), module.group_size)


def prepare(module) -> None:
    """One-time work per layer at load: CPU repacks for torch's packed ops, cached on the module."""
    module._cpu_int4 = None
    module._cpu_int8 = None
    module._cpu_w4a8 = None
    module._cpu_path = None
    if module.weight_packed.device.type == "cpu" and (module.weight_scale.dtype == torch.bfloat16
                                                       or getattr(module, "cpu_bf16_activations", False)):
        wp, sc, zp, gi, gs = _tensors(module)
        if module.bits == 4:
            module._cpu_int4 = cpu.repack_int4(wp, sc, zp, gi, gs, module.in_features)
        elif module.bits == 8:
            module._cpu_int8 = cpu.repack_int8(wp, sc, zp, module.in_features)
    module._qk_prepared = True


CPU_PATHS = ("cpu-int4pack", "cpu-int8pack", "cpu-w4a8", "torch-dequant-matmul")


def w4a8_pack(module):
    """The module's cpu_w4a8 layout, made on first use (None where the op or the weight's layout rules it out)."""
    if getattr(module, "_cpu_w4a8", None) is None and module.bits == 4 and module.weight_packed.device.type == "cpu" \
            and cpu_w4a8.available():
        wp, sc, zp, gi, gs = _tensors(module)
        module._cpu_w4a8 = cpu_w4a8.repack(wp, sc, zp, gi, gs, module.in_features)
    return getattr(module, "_cpu_w4a8", None)


def use_cpu_path(module, path: str) -> None:
    """Run `module` by `path` on the CPU (the runtime's measured choice, kernels/path_choice.py); a packed
    layout it no longer uses is let go, so its memory is freed and fused.py does not stack it."""
    if path not in CPU_PATHS:
        raise ValueError(f"{path} is not a CPU path of a quantised Linear")
    if path == "cpu-w4a8" and w4a8_pack(module) is None:
        raise ValueError(f"cpu-w4a8 cannot run {module.out_features}x{module.in_features} w{module.bits}")
    module._cpu_path = path
    if path != "cpu-int4pack":
        module._cpu_int4 = None
    if path != "cpu-int8pack":
        module._cpu_int8 = None
    if path != "cpu-w4a8":
        module._cpu_w4a8 = None


def _measured_cpu_path(module) -> str | None:
    path = getattr(module, "_cpu_path", None)
    if path == "cpu-int4pack" and getattr(module, "_cpu_int4", None) is None:
        return None
    if path == "cpu-int8pack" and getattr(module, "_cpu_int8", None) is None:
        return None
    if path == "cpu-w4a8" and getattr(module, "_cpu_w4a8", None) is None:
        return None
    return path


def choose(module, rows: int, x: torch.Tensor) -> str:
    dev = x.device
    cuda_ok = dev.type == "cuda" and cuda_ready()
    return decide(dev.type, rows, x.dtype, module, forced_kernel(), cuda_ok=cuda_ok, triton_ok=triton_usable(dev))


def decide(device_type: str, rows: int, dtype: torch.dtype, module, forced: str | None, *, cuda_ok: bool,
           triton_ok: bool) -> str:
    """The kernel path for `rows` activations of `dtype` on a device of `device_type`, given which kernel families
    can run there. A pure decision (no device is touched), so it is tested by device name. torch's packed CPU ops
    (FBGEMM / oneDNN layouts) are chosen on "cpu" only: on a GPU they would run on the host."""
    gi_present = getattr(module, "weight_g_idx", None) is not None
    if forced == "reference":
        return "reference"
    if module.bits not in (4, 8):  # 2/3 bits have no fused kernel on any device: dequantise, then a float matmul
        return "torch-dequant-matmul"
    if forced == "triton":
        if not triton_ok:
            raise UserError(f"{ENV}=triton needs triton and a CUDA tensor (or TRITON_INTERPRET=1 on CPU); "
                            f"got a {device_type} tensor; unset {ENV}")
        return "triton-gemv" if rows <= CUDA_GEMV_MAX_ROWS else "triton-gemm"
    gemv_ok = gemv_supported(module.in_features, module.group_size, gi_present, module.bits, rows, dtype)
    if forced == "cuda":
        if device_type != "cuda" or not cuda_ok:
            raise UserError(f"{ENV}=cuda needs a CUDA GPU with the quantkit CUDA kernels built; unset {ENV}")
        if gemv_ok:
            return "cuda-gemv"
        # the tensor-core GEMM only when forced until bench/kernels_gpu.py has measured it against Triton
        tc_ok = tc_supported(module.in_features, module.group_size, gi_present, module.bits, rows, dtype)
        return "cuda-tc" if tc_ok else "cuda-dequant-matmul"
    if device_type == "cpu":
        measured = _measured_cpu_path(module) if forced is None else None
        if measured is not None:
            return measured
        # fp32/fp16 activations take the packed ops only when the loader opted in (runtime): they then run in
        # bf16, ~4e-3 relative error per product, far below W4's own error, for a 50-200x faster layer
        packed_ok = dtype == torch.bfloat16 or getattr(module, "cpu_bf16_activations", False)
        if packed_ok and getattr(module, "_cpu_int4", None) is not None:
            return "cpu-int4pack"
        if packed_ok and getattr(module, "_cpu_int8", None) is not None:
            return "cpu-int8pack"
        return "torch-dequant-matmul"
    if forced == "torch":
        return "torch-dequant-matmul"
    if cuda_ok and gemv_ok:
        return "cuda-gemv"
    if triton_ok:
        if rows <= CUDA_GEMV_MAX_ROWS:
            return "triton-gemv"
        if rows <= TRITON_GEMM_MAX_ROWS:
            return "triton-gemm"
        return "triton-dequant-matmul"
    return "cuda-dequant-matmul" if cuda_ok else "torch-dequant-matmul"


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

        wp, sc, zp, gi, _ = cuda_args(module, x2.dtype)
        dequantize_int(wp, sc, zp, gi, gs, module.bits, k, out=buf)
    else:
        cpu.dequantize_into(buf, wp, sc, zp, gi, gs, module.bits)
    bias = module.bias
    if bias is None:
        return x2 @ buf.t()
    return torch.addmm(bias.to(x2.dtype), x2, buf.t())


def linear_forward(module, x: torch.Tensor) -> torch.Tensor:
    """y = x @ W^T + b for a QuantLinear, in x.dtype, by the kernel `choose` picks for this device and size."""
    pack = getattr(module, "_cpu_w4a8", None)
    if pack is not None and module._cpu_path == "cpu-w4a8" and x.shape[-1] == module.in_features \
            and forced_kernel() is None:
        # the measured W4A8 path, taken here only: what choose() would decide, without its ~9 us of Python per
        # call (a W4 SmolLM2 decode step makes 120 of them)
        cpu.check_activation(x)
        y = cpu_w4a8.matmul(pack, x.reshape(-1, module.in_features))
        if module.bias is not None:
            y = y + module.bias.to(y.dtype)
        return y.to(x.dtype).reshape(*x.shape[:-1], module.out_features)
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
    elif path in ("cuda-gemv", "cuda-tc"):
        from .cuda import gemm_w4a16_tc, gemv_w4a16

        cwp, csc, czp, cgi, cbias = cuda_args(module, x.dtype)
        if path == "cuda-gemv":
            y = gemv_w4a16(x2.contiguous(), cwp, csc, czp, cgi, gs, cbias)
        else:
            y = gemm_w4a16_tc(x2.contiguous(), cwp, csc, czp, gs, cbias)
    elif path in ("cpu-int4pack", "cpu-int8pack"):
        xb = x2.to(torch.bfloat16)
        y = cpu.int4_matmul(module._cpu_int4, xb) if path == "cpu-int4pack" else cpu.int8_matmul(module._cpu_int8, xb)
        if bias is not None:
            y = y + bias.to(y.dtype)
        y = y.to(x.dtype)
    else:
        y = _dequant_matmul(module, x2, path)
    return y.reshape(*x.shape[:-1], module.out_features)
