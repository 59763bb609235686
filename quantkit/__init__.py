"""quantkit: post-training quantisation for Hugging Face causal LMs."""
from .version import __version__  # noqa: F401


def __getattr__(name):
    """`quantkit.load` is runtime/checkpoint.py's own function, not a wrapper with defaults of its own; it is
    imported on first use so that `import quantkit` (the CLI's start) does not load torch and transformers."""
    if name == "load":
        from .runtime.checkpoint import load

        return load
    raise AttributeError(f"module 'quantkit' has no attribute '{name}'")
