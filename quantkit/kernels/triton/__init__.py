"""Triton kernels for the pack-quantized layout. Triton is optional at run time: importing this package
without it raises ImportError with the reason; `available()` in quantkit.kernels.dispatch checks first."""
try:
    import triton  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised only where triton is absent
    raise ImportError("quantkit.kernels.triton needs the 'triton' package (pip install triton); "
                      "without it quantkit uses the CUDA or PyTorch paths") from e

from .dequant import dequantize_fp8, dequantize_int
from .matmul import GEMV_MAX_ROWS, w4a16_matmul, w8a16_matmul, wna16_matmul

__all__ = ["dequantize_int", "dequantize_fp8", "wna16_matmul", "w4a16_matmul", "w8a16_matmul", "GEMV_MAX_ROWS"]
