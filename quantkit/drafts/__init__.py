"""Draft sources for speculative decoding that are built, not just loaded: the runtime is handed ready models."""
from .factory import drafter_factory
from .self_w4 import self_w4_draft

__all__ = ["drafter_factory", "self_w4_draft"]
