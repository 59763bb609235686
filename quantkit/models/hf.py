"""Load the float model to quantise: a local Hugging Face folder, a hub id, or the embedded default."""
from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from ..dtypes import parse_dtype, stored_dtype
from ..errors import UserError
from .shape_check import check_weights_match

# Architectures whose projections are nn.Linear and that the tests exercise; other causal LMs with nn.Linear
# projections work too, this list is what error messages point at.
SUPPORTED = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "opt"]


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _looks_like_path(model: str) -> bool:
    """A hub id is 'org/name'; when 'org' is a local folder, 'org/name' is a mistyped path, not a hub id."""
    return not _HUB_ID.match(model) or model.startswith(".") or Path(model.split("/")[0]).is_dir()


def resolve_model_dir(model: str | None) -> Path:
    """A local folder holding config.json for MODEL (folder, hub id, .gguf file, or None = embedded). A GGUF file
    is read as the float folder its dequantised weights make (models/gguf_float.py, converted once)."""
    if not model:
        from .embedded import embedded_model_dir

        return embedded_model_dir()
    from .gguf_float import float_folder, is_gguf

    p = Path(model).expanduser()
    if is_gguf(p):
        return float_folder(p)
    if p.exists() or _looks_like_path(model):
        if not p.exists():
            raise UserError(f"model folder '{model}' does not exist; pass a Hugging Face model folder or a hub id "
                            "like Qwen/Qwen2.5-0.5B")
        if not p.is_dir() or not (p / "config.json").is_file():
            raise UserError(f"'{model}' is not a Hugging Face model folder (no config.json); pass the folder that "
                            "save_pretrained wrote")
        return p
    return _hub_snapshot(model)


def _hub_snapshot(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True))
    except Exception:
        pass
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, etag_timeout=5))
    except Exception as e:
        raise UserError(f"could not get '{repo_id}' from the Hugging Face hub ({type(e).__name__}): it is not "
                        "cached and the hub is unreachable; download it where there is internet and pass the "
                        "local folder") from None


def check_architecture(config) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    mt = getattr(config, "model_type", None)
    if mt not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UserError(f"model type '{mt}' is not a causal language model quantkit supports; supported: "
                        f"{', '.join(SUPPORTED)} (and other transformers causal LMs with nn.Linear projections)")


def resolve_dtype(dtype: str, config) -> torch.dtype:
    """The recipe's dtype, or for 'auto' the one config.json says the weights are stored in."""
    chosen = parse_dtype(dtype)
    if chosen is not None:
        return chosen
    d = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    return d if isinstance(d, torch.dtype) else stored_dtype(d)


def read_config(src: Path):
    """The model's config, checked: readable, a supported causal LM, not already quantised."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(src)
    except Exception as e:
        raise UserError(f"{src}/config.json cannot be read ({str(e).splitlines()[0][:120]}); fix or re-save the model") from None
    check_architecture(config)
    if getattr(config, "quantization_config", None):
        raise UserError(f"'{src}' is already quantised ({config.quantization_config.get('quant_method', '?')}); "
                        "pass the original float model")
    return config


def load_error(src: Path, e: Exception) -> UserError:
    """The one-line UserError for a model whose weights cannot be read."""
    msg = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
    if "safetensors" in msg.lower() or "header" in msg.lower() or type(e).__name__ == "SafetensorError":
        return UserError(f"a safetensors file in '{src}' is corrupt ({msg}); re-download or re-save the model")
    return UserError(f"cannot load the model in '{src}': {msg}")


def load_tokenizer(src: Path):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(src)
    except Exception:
        return None
    # with no tokenizer files, transformers builds some model types' tokenizer from nothing: special tokens
    # only. Calibrating on it would sample nothing but those, so it counts as no tokenizer.
    return tok if len(tok) > len(set(tok.all_special_ids)) else None


def load_float_model(model: str | None, dtype: str = "auto", device: str = "cpu"):
    """(model, tokenizer or None, source folder). The source folder is only read, never written."""
    from transformers import AutoModelForCausalLM

    src = resolve_model_dir(model)
    config = read_config(src)
    torch_dtype = resolve_dtype(dtype, config)
    check_weights_match(src, meta_model(config, torch_dtype))
    try:
        m = AutoModelForCausalLM.from_pretrained(src, dtype=torch_dtype)
    except Exception as e:
        raise load_error(src, e) from None
    m.eval()
    check_linear_projections(m)
    return m, load_tokenizer(src), src


def meta_model(config, dtype: torch.dtype) -> nn.Module:
    """The model CONFIG describes, on the meta device (no memory), with its tied weights tied."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        m = AutoModelForCausalLM.from_config(config, dtype=dtype)
    m.tie_weights()
    return m.eval()


def check_linear_projections(model: nn.Module) -> None:
    from transformers.pytorch_utils import Conv1D

    if any(isinstance(m, Conv1D) for m in model.modules()):
        raise UserError(f"{type(model).__name__} uses GPT-2-style Conv1D projections, which quantkit does not quantise; "
                        f"supported: {', '.join(SUPPORTED)}")


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The ModuleList of decoder blocks (the longest ModuleList whose length is num_hidden_layers)."""
    n = getattr(model.config, "num_hidden_layers", None)
    best = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0 and (n is None or len(mod) == n):
            if best is None or len(mod) > len(best[1]):
                best = (name, mod)
    if best is None:
        raise UserError(f"cannot find the decoder layers of {type(model).__name__}; supported: {', '.join(SUPPORTED)}")
    return best
