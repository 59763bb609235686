"""quantkit: post-training quantisation for Hugging Face causal LMs."""
__version__ = "0.1.0"


def load(path, device: str = "cpu", dtype=None):
    """Load a quantkit checkpoint (or float HF folder) as a transformers model with QuantLinear layers."""
    from .runtime.loader import load as _load

    return _load(path, device=device, dtype=dtype)
