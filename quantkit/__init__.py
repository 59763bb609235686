"""quantkit: post-training quantisation for Hugging Face causal LMs."""
from .version import __version__  # noqa: F401


def load(path, device: str = "cpu", dtype=None, cpu_fast: bool = False):
    """Load a quantkit checkpoint (or float HF folder) as a transformers model with QuantLinear layers.

    cpu_fast runs quantised layers on CPU through torch's packed ops with bf16 activations (see runtime.loader).
    """
    from .runtime.loader import load as _load

    return _load(path, device=device, dtype=dtype, cpu_fast=cpu_fast)
