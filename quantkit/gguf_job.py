"""The GGUF export job: a Hugging Face Llama-family or Qwen2 folder -> one .gguf file llama.cpp runs.

Tensors are read one at a time from the folder's safetensors (no model is built), given their llama.cpp
name and their type from the scheme's mix (formats/gguf_mix.py), rounded onto that type's grid by the
block encoder's own weighted search (RTN), and written; norms stay float32. The file is written beside OUT
and renamed into place, so a killed run never leaves a half file under OUT's name."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

import torch

from .errors import UserError
from .formats import gguf_mix, gguf_writer

# the solvers that run on GGUF grids today: auto is rtn weighted by calibration activations, rtn uses no data;
# the others are refused by name
GGUF_METHODS = ("auto", "rtn", "gptq")


def _check(scheme: str, method: Optional[str], output: Optional[str], overwrite: bool) -> tuple[str, Path]:
    scheme = gguf_mix.check_scheme(scheme or "q4_k_m")
    if (method or "auto") not in GGUF_METHODS:
        raise UserError(f"--method {method} does not run on GGUF grids yet; with --format gguf use --method auto "
                        "(the default), rtn or gptq (docs/gguf.md lists which solver takes which type)")
    if not output:
        raise UserError("--format gguf needs -o OUT.gguf")
    out = Path(output)
    if out.is_dir():
        raise UserError(f"-o {output} is a folder; --format gguf writes one file, e.g. -o {out / 'model.gguf'}")
    if out.exists() and not overwrite:
        raise UserError(f"{output} exists; pass --overwrite to replace it")
    return scheme, out


def _tensors(src: Path):
    """(name, tensor) for every tensor in the folder's safetensors, one at a time."""
    from safetensors import safe_open

    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise UserError(f"{src} has no .safetensors files; GGUF export reads safetensors weights")
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                yield name, st.get_tensor(name)


def _weight(config, role: str, t: torch.Tensor) -> torch.Tensor:
    t = t.float()
    if not gguf_writer.rotates_pairs(config):
        return t
    if role == "attn_q":
        return gguf_writer.permute_qk(t, config.num_attention_heads)
    if role == "attn_k":
        return gguf_writer.permute_qk(t, config.num_key_value_heads)
    return t


def _write_one(f, config, scheme: str, tied: bool, name: str, t: torch.Tensor, decoded: Optional[dict],
               hessians: dict, importance: dict) -> Optional[str]:
    from .formats.gguf_codec import decode, encode
    from .solvers.gguf_gptq import gguf_gptq

    named = gguf_writer.gguf_name(name)
    if named is None:
        return None
    role, layer = named
    key = gguf_writer.tensor_key(role, layer, name)
    if t.dim() == 1:
        f.add_float(key, _weight(config, role, t).numpy())
        return "F32"
    mix_role = "output" if role == "output" or (tied and role == "token_embd") else role
    kind = gguf_mix.tensor_type(scheme, mix_role, layer, config.num_hidden_layers, t.shape[1])
    w = _weight(config, role, t)
    if kind == "F16":
        f.add_float(key, w.numpy(), f16=True)
        return kind
    H = hessians.get(name)
    if H is not None and kind != "IQ4_NL":
        blocks, raw = gguf_gptq(w, H, kind)
    else:
        blocks, raw = encode(w, kind, importance=importance.get(name))
    f.add_blocks(key, raw, kind)
    if decoded is not None:  # back in Hugging Face's row order, for comparing with the float model
        q = decode(blocks, w.shape)
        decoded[name] = _unpermute(config, role, q)
    return kind


def gather_hessians(model: Optional[str], calib: Optional[str], num_samples: int, seq_len: int,
                    diagonal: bool = False, prior: int = 0) -> tuple[dict, int]:
    """({Hugging Face weight name: H = 2 XᵀX / tokens}, tokens) (with diagonal, only its diagonal: each input column's
    mean squared activation, times 2) for every Linear but the output head, from hooks in one pass of the float
    model over the calibration samples: not layer-sequential like the compressed-tensors pipeline (each layer
    sees the float model's inputs, not its quantised predecessors'). With PRIOR, each H gives up
    prior / (prior + tokens) of its off-diagonal part, as GPTQ's solve reads it (solvers/decorrelation.py)."""
    from .data.calibration import load_calibration
    from .models.hf import load_float_model

    net, tok, _src = load_float_model(model, dtype="float32")
    samples = load_calibration(calib, tok, num_samples=num_samples, seq_len=seq_len, model=net).samples
    sums: dict = {}
    counts: dict = {}

    def hook(name):
        def add(_mod, args, _out):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            sums[name] = sums.get(name, 0) + ((x * x).sum(0) if diagonal else x.T @ x)
            counts[name] = counts.get(name, 0) + x.shape[0]
        return add

    handles = [m.register_forward_hook(hook(f"{n}.weight")) for n, m in net.named_modules()
               if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head")]
    try:
        with torch.no_grad():
            for s in samples:
                net(s.unsqueeze(0))
    finally:
        for h in handles:
            h.remove()
    from .solvers.decorrelation import decorrelation, toward_diagonal

    tokens = sum(s.numel() for s in samples)
    share = 0.0 if diagonal else decorrelation(tokens, prior)
    return {k: toward_diagonal(2 * v / counts[k], share) for k, v in sums.items()}, tokens


def _unpermute(config, role: str, w: torch.Tensor) -> torch.Tensor:
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}.get(role)
    if heads is None or not gguf_writer.rotates_pairs(config):
        return w
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


def quantize_to_gguf(model: Optional[str], output: Optional[str], scheme: Optional[str] = None,
                     method: Optional[str] = None, overwrite: bool = False, decoded: Optional[dict] = None,
                     calib: Optional[str] = None, num_samples: Optional[int] = None, seq_len: Optional[int] = None) -> dict:
    """Write OUT.gguf; `decoded`, when given, is filled with each quantised weight as llama.cpp decodes it
    (Hugging Face names and layout). auto (the default) and gptq calibrate on `calib` (default: text the model
    samples itself); rtn uses no data; the token embedding (a lookup, no inputs) is never weighted. Returns a
    summary: types used (tensor count per type), bytes, seconds."""
    from .models.hf import read_config, resolve_model_dir

    scheme, out = _check(scheme, method, output, overwrite)
    t0 = time.time()
    src = resolve_model_dir(model)
    config = read_config(src)
    gguf_writer.check_config(config)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    hessians, importance, decorrelate = {}, {}, None
    if method == "gptq":
        from .solvers.decorrelation import decorrelation
        from .solvers.gptq_options import PRIOR_TOKENS

        # the compressed-tensors GPTQ's prior: without it, GPTQ on 2,048 tokens of prose lost to rtn on code for
        # every type of bench/gguf.py's table (2026-12-04)
        hessians, tokens = gather_hessians(model, calib, num_samples or 128, seq_len or 512, prior=PRIOR_TOKENS)
        decorrelate = decorrelation(tokens, PRIOR_TOKENS)
    elif method in (None, "auto") and scheme != "f16":
        # each input column's mean squared activation weighs its rounding error (llama.cpp's importance-matrix
        # idea): on SmolLM2 it took 1.4-9% off rtn's perplexity on the held-out texts of bench/gguf.py
        importance = gather_hessians(model, calib, num_samples or 128, seq_len or 512, diagonal=True)[0]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.part")
    types: dict[str, int] = {}
    try:
        f = gguf_writer.GGUFFile(tmp, src, config, gguf_mix.SCHEMES[scheme][1], src.name)
        for name, t in _tensors(src):
            if tied and name == "lm_head.weight":
                continue
            kind = _write_one(f, config, scheme, tied, name, t, decoded, hessians, importance)
            if kind:
                types[kind] = types.get(kind, 0) + 1
        f.close()
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    used = "gptq" if hessians else "rtn, activation-weighted" if importance else "rtn"
    return {"output": str(out), "format": "gguf", "scheme": scheme, "method": used, "types": types,
            **({"hessian_decorrelate": round(decorrelate, 4)} if decorrelate is not None else {}),
            "bytes": out.stat().st_size, "seconds": round(time.time() - t0, 1)}
