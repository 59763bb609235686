"""CUDA C++ kernels (dequant, W4A16 GEMV, tensor-core W4A16 GEMM) as `quantkit::` torch ops, JIT-built on first use.

Importing this package on a machine without a CUDA GPU raises ImportError saying so; the dispatcher checks
`quantkit.kernels.dispatch.cuda_ready()` and never selects these kernels there. The ops' schemas, fakes and
argument checks live in quantkit/kernels/cuda_library.py, which imports anywhere.
"""
import torch

if not torch.cuda.is_available():
    raise ImportError("quantkit.kernels.cuda needs a CUDA GPU and a CUDA build of torch "
                      f"(this torch is {torch.__version__}, torch.cuda.is_available() is False); "
                      "on CPU quantkit uses the PyTorch or Triton-interpreter paths instead")

from .ops import (GEMV_MAX_ROWS, TC_MAX_ROWS, dequantize_fp8, dequantize_int, gemm_w4a16_tc,  # noqa: E402
                  gemv_supported, gemv_w4a16, load, tc_supported)

# Importing is first use: the ops below are only callable once the library has registered them (the first GPU run
# found every direct caller failing with "no attribute 'gemv_w4a16'" because only the dispatcher loaded it).
load()

__all__ = ["load", "dequantize_int", "dequantize_fp8", "gemv_w4a16", "gemm_w4a16_tc", "gemv_supported",
           "tc_supported", "GEMV_MAX_ROWS", "TC_MAX_ROWS"]
