"""An EAGLE-style draft head: one decoder layer over the target's own features, sharing its embedding and head.

Position j reads fc(concat(embedding(x_j), f_{j-1})), where f_{j-1} is the target's final-norm hidden state at
the previous position (what its output head turns into the distribution x_j was drawn from), and predicts f_j;
the target's frozen output head turns that into a draft distribution for x_{j+1}. The layer is a pre-norm Llama
block whose input norm is left out (EAGLE's and vLLM's choice: fc's output is not a residual stream yet), and
nothing follows it but the target's head.

Saved as model.safetensors + config.json in the names vLLM's EagleLlamaForCausalLM reads (`fc.weight`,
`layers.0.self_attn.q_proj.weight`, ...; docs/drafts.md): the embedding and the head are not saved, both
come from the target at load time.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from ..errors import UserError
from . import draft_vocab

ARCH = "EagleLlamaForCausalLM"
WEIGHTS, CONFIG = "model.safetensors", "config.json"
_KEEP = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
         "rms_norm_eps", "vocab_size", "max_position_embeddings", "rope_parameters", "rope_theta", "rope_scaling",
         "hidden_act", "bos_token_id", "eos_token_id", "tie_word_embeddings")


class _RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class _Attention(torch.nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = torch.nn.Linear(d, heads * head_dim, bias=False)
        self.k_proj = torch.nn.Linear(d, kv_heads * head_dim, bias=False)
        self.v_proj = torch.nn.Linear(d, kv_heads * head_dim, bias=False)
        self.o_proj = torch.nn.Linear(heads * head_dim, d, bias=False)


class _Mlp(torch.nn.Module):
    def __init__(self, d: int, inner: int):
        super().__init__()
        self.gate_proj = torch.nn.Linear(d, inner, bias=False)
        self.up_proj = torch.nn.Linear(d, inner, bias=False)
        self.down_proj = torch.nn.Linear(inner, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(torch.nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        d, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or d // heads
        self.self_attn = _Attention(d, heads, cfg.get("num_key_value_heads") or heads, head_dim)
        self.post_attention_layernorm = _RMSNorm(d, cfg.get("rms_norm_eps", 1e-6))
        self.mlp = _Mlp(d, cfg["intermediate_size"])


class HeadCache:
    """The head's keys and values, [1, kv_heads, n, head_dim], with each entry's position (positions need not
    be contiguous: a position whose target feature never arrived is simply absent)."""

    def __init__(self):
        self.k = self.v = None
        self.pos = torch.zeros(0, dtype=torch.long)

    def keep_before(self, position: int) -> None:
        n = int((self.pos < position).sum())  # entries are appended in position order
        if n < self.pos.numel():
            self.k, self.v, self.pos = self.k[:, :, :n], self.v[:, :, :n], self.pos[:n]


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class EagleHead(torch.nn.Module):
    def __init__(self, cfg: dict, rotary):
        """cfg: the head's config.json as a dict; rotary: the target's rotary embedding module (its RoPE table,
        with whatever scaling the target uses), kept outside this module's parameters and state."""
        super().__init__()
        self.cfg = cfg
        d = cfg["hidden_size"]
        self.fc = torch.nn.Linear(2 * d, d, bias=False)
        self.layers = torch.nn.ModuleList([_Layer(cfg)])
        self._rotary = (rotary,)
        n = cfg.get("draft_vocab_size")
        if n and n != cfg["vocab_size"]:  # a reduced draft vocabulary (drafts/draft_vocab.py): saved with the head
            self.register_buffer(draft_vocab.D2T, torch.zeros(n, dtype=torch.long))
        self.out_w = self.out_b = None  # the output rows it drafts over: attach_output

    @property
    def vocab_ids(self) -> torch.Tensor | None:
        """The target ids the head drafts among (sorted), or None for the whole vocabulary."""
        d2t = getattr(self, draft_vocab.D2T, None)
        return None if d2t is None else draft_vocab.from_d2t(d2t.cpu()).to(d2t.device)

    def attach_output(self, target) -> "EagleHead":
        """Take the target's output rows for the head's vocabulary: a float32 copy made once here, shared by
        every drafter of this head (the full vocabulary keeps using the target's own output module)."""
        ids = self.vocab_ids
        if ids is not None:
            w, b = draft_vocab.gathered_rows(target, ids)
            self.out_w, self.out_b, self.out_ids = w.to(self.fc.weight.device), b, ids
        return self

    def draft_logits(self, g: torch.Tensor) -> torch.Tensor:
        """Logits [..., V] over the whole vocabulary for predicted features g [..., D] of a reduced-vocabulary
        head: the N gathered rows' product, spread with -inf outside the subset."""
        sub = g.float() @ self.out_w.T
        if self.out_b is not None:
            sub = sub + self.out_b
        return draft_vocab.spread(sub, self.out_ids, self.cfg["vocab_size"])

    def forward(self, emb: torch.Tensor, feats: torch.Tensor, pos: torch.Tensor,
                cache: HeadCache | None = None) -> torch.Tensor:
        """emb, feats [B, T, D] (embedding of x_j, target feature f_{j-1}), pos [B, T] -> predicted f_j [B, T, D].
        With a cache (B == 1) the new keys are appended to it and attend over it; without, the T positions
        attend causally among themselves (training)."""
        layer = self.layers[0]
        attn = layer.self_attn
        x = self.fc(torch.cat([emb, feats], dim=-1))
        B, T, _ = x.shape
        cos, sin = self._rotary[0](x, pos)
        cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
        q = _rotate(attn.q_proj(x).view(B, T, attn.heads, -1).transpose(1, 2), cos, sin)
        k = _rotate(attn.k_proj(x).view(B, T, attn.kv_heads, -1).transpose(1, 2), cos, sin)
        v = attn.v_proj(x).view(B, T, attn.kv_heads, -1).transpose(1, 2)
        if cache is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            if cache.k is not None:
                k, v = torch.cat([cache.k, k], dim=2), torch.cat([cache.v, v], dim=2)
            cache.k, cache.v = k, v
            cache.pos = torch.cat([cache.pos, pos[0].cpu()])
            # new query t sees every cached key and the new keys up to itself
            seen = torch.arange(k.shape[2])[None, :] <= torch.arange(k.shape[2] - T, k.shape[2])[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=seen.to(q.device), enable_gqa=True)
        h = x + attn.o_proj(o.transpose(1, 2).reshape(B, T, -1))
        return h + layer.mlp(layer.post_attention_layernorm(h))


def head_config(target, extra: dict | None = None) -> dict:
    """The head's config: the target's shapes, one layer, vLLM's architecture name, and quantkit's notes."""
    full = target.config.to_dict()
    cfg = {key: full[key] for key in _KEEP if full.get(key) is not None}
    cfg.update(architectures=[ARCH], model_type="llama", num_hidden_layers=1,
               quantkit_draft={"kind": "eagle", "target_layers": full.get("num_hidden_layers"), **(extra or {})})
    return cfg


def new_head(target, seed: int = 0, extra: dict | None = None, vocab_ids: torch.Tensor | None = None) -> EagleHead:
    """A fresh head for `target`; vocab_ids (sorted target ids) makes it draft among those tokens only."""
    torch.manual_seed(seed)
    cfg = head_config(target, extra)
    if vocab_ids is not None:
        cfg["draft_vocab_size"] = int(vocab_ids.numel())
    head = EagleHead(cfg, target.model.rotary_emb).float()
    if vocab_ids is not None:
        getattr(head, draft_vocab.D2T).copy_(draft_vocab.to_d2t(vocab_ids.cpu()))
    return head


def is_head_dir(path) -> bool:
    cfg = Path(path) / CONFIG
    if not cfg.is_file():
        return False
    try:
        return ARCH in (json.loads(cfg.read_text()).get("architectures") or [])
    except (OSError, ValueError):
        return False


def save_head(head: EagleHead, out) -> None:
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # weights as float32; the draft vocabulary's d2t stays int64, as EAGLE-3 heads store it
    state = {name: (t.detach().float() if t.is_floating_point() else t.detach()).contiguous().cpu()
             for name, t in head.state_dict().items()}
    save_file(state, str(out / WEIGHTS), metadata={"format": "pt"})
    (out / CONFIG).write_text(json.dumps(head.cfg, indent=2) + "\n")


def load_head(path, target) -> EagleHead:
    """The head saved at `path`, checked against the target it will draft for."""
    from safetensors.torch import load_file

    path = Path(path)
    inner = getattr(target, "model", None)
    if not (hasattr(inner, "rotary_emb") and hasattr(inner, "norm")):
        raise UserError(f"--draft {path}: a draft head needs a Llama-family target (rotary positions, a final "
                        f"norm); {type(target).__name__} is not one: use --draft self-w4 or --prompt-lookup")
    cfg = json.loads((path / CONFIG).read_text())
    tcfg = target.config
    for key in ("hidden_size", "vocab_size"):
        if cfg.get(key) != getattr(tcfg, key, None):
            raise UserError(f"draft head {path} was trained for a model with {key}={cfg.get(key)}, but the target "
                            f"has {getattr(tcfg, key, None)}; train one for this model with "
                            f"`quantkit draft train MODEL -o HEAD`")
    head = EagleHead(cfg, target.model.rotary_emb).float()
    state = load_file(str(path / WEIGHTS))
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise UserError(f"draft head {path} does not hold the expected tensors (missing {missing[:3]}, "
                        f"unexpected {unexpected[:3]}); retrain it with `quantkit draft train`")
    ids = head.vocab_ids
    if ids is not None and (ids.numel() < 1 or int(ids.min()) < 0 or int(ids.max()) >= cfg["vocab_size"]
                            or not bool((ids[1:] > ids[:-1]).all())):
        raise UserError(f"draft head {path}: its draft vocabulary ('d2t') is not a sorted set of the target's "
                        f"token ids; retrain it with `quantkit draft train`")
    return head.eval().requires_grad_(False).attach_output(target)
