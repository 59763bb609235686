"""Capture and solve, one decoder layer at a time: quantize_model is the pipeline's one entry point."""
from .sequential import QuantizeResult, quantize_model

__all__ = ["QuantizeResult", "quantize_model"]
