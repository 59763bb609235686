"""`quantkit.load`: the one way to open a checkpoint (or a float Hugging Face folder), with one set of defaults.

generate, serve, the playground, eval (its scoring and its quantkit backend), drafts, `quantkit draft` and
bench/ all open models here, so the model a user loads in Python is the model the commands decode with.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..devices import resolve_device
from ..dtypes import parse_dtype
from ..errors import UserError
from .loader import read_model


def resolve_path(path) -> str:
    """A model folder, or 'embedded' for the built-in SmolLM2-135M."""
    path = str(path)
    if path in ("embedded", "smollm2"):
        from ..models.embedded import embedded_model_dir

        return str(embedded_model_dir())
    if not Path(path).is_dir():
        raise UserError(f"{path} is not a model folder; give a quantkit checkpoint or Hugging Face model folder "
                        "(or 'embedded' for the built-in SmolLM2-135M)")
    return path


def load(path, device: str = "cpu", dtype=None, exact: bool = False) -> torch.nn.Module:
    """PATH: a quantkit checkpoint, a Hugging Face model folder, or 'embedded'. device: cpu, cuda, cuda:N or auto.
    dtype: float32, float16, bfloat16, auto or a torch dtype.

    Default: the model the runtime decodes with. On the CPU, dtype None means float32 whatever the checkpoint
    stores (float32 activations are exact there, and a float16 checkpoint's weights still read as float16,
    linear/relayout.py); quantised layers run torch's packed int4/int8 ops with bf16 activations, and weights
    are laid out and fused for decoding as the model loads (~1e-3 relative difference in logits). On CUDA, dtype
    None keeps the checkpoint's dtype (the GPU kernels take float16/bfloat16 activations) and no CPU layout is
    built. exact=True: the checkpoint's own modules in the asked dtype (the checkpoint's when None), dequantised
    then multiplied as transformers does: for comparing engines, scoring, and training against the model.

    Every load runs the checkpoint's integrity checks (formats/) before any tensor is trusted."""
    path, device, dtype = resolve_path(path), resolve_device(device), parse_dtype(dtype)
    if exact:
        return read_model(path, device=device, dtype=dtype)
    if device == "cpu":
        return read_model(path, device="cpu", dtype=dtype or torch.float32, cpu_fast=True, relayout=True)
    return read_model(path, device=device, dtype=dtype, cpu_fast=False, relayout=False)
