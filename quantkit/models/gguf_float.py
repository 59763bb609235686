"""A GGUF file as a float Hugging Face folder, so everything that reads model folders (eval, the runtime,
quantize) reads GGUF too.

transformers' GGUF loader dequantises every tensor with the `gguf` package (the same values llama.cpp's own
dequantisation gives: tests/test_gguf_export.py) and undoes llama.cpp's Q/K row interleave. It refuses to
save_pretrained a GGUF-loaded model, so a fresh model is built from the config and given the state dict, then saved
once under the cache, keyed by the file's sha256, so later reads take a second instead of a minute.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from ..cache_dir import cache_root
from ..errors import UserError


def is_gguf(path: Path) -> bool:
    """The one test of whether a model argument names a GGUF file."""
    return path.suffix == ".gguf" and path.is_file()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def float_folder(gguf: Path, target: Path | None = None, dtype: str = "float32") -> Path:
    """TARGET (default: under the cache, by content), a DTYPE Hugging Face folder of GGUF, converted on first use.
    float32 by default: a k-quant's dequantised values (fp16 scales times 6-bit sub-scales times codes) are not
    all float16 numbers."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = Path(gguf).expanduser().resolve()
    if not gguf.is_file():
        raise UserError(f"{gguf} is not a file; give a .gguf file")
    if target is None:
        target = cache_root() / "gguf" / f"{gguf.stem}-{_sha256(gguf)[:16]}-{dtype}"
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    torch_dtype = getattr(torch, dtype)
    try:
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except (ValueError, KeyError, OSError, RuntimeError) as e:
        raise UserError(f"transformers cannot read {gguf} ({str(e).splitlines()[0][:200]}); it reads the "
                        "architectures and tensor types its GGUF loader lists") from None
    config.dtype = dtype
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    fresh.load_state_dict({k: v.to(torch_dtype) for k, v in loaded.state_dict().items()}, strict=False)
    fresh.tie_weights()
    fresh.generation_config = loaded.generation_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        fresh.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if target.exists():  # a concurrent conversion finished first: keep it
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
