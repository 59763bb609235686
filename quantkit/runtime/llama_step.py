"""Our own forward for Llama-family decoders over a SlotPool: a batch of sequences at different lengths in one pass.

It calls the model's own modules (embedding, norms, projections, MLP, rotary table, head), so quantised
Linears, the float16 head copy and any RoPE scaling are what transformers would run; what it replaces is the
glue: the per-sequence cache objects, the mask builders and the generic layer plumbing. That glue was a third of
a batch-1 CPU decode step (docs/benchmarks.md), and it is what stopped concurrent requests from sharing one
forward.

Each item is (handle, ids): n_i new tokens for one sequence whose cache holds L_i. Rows are padded to the longest
n; row i's token t sits at position L_i + t and attends to keys 0..L_i + t, so the padding's keys (written past
the row's length) are never read by a real token and are overwritten later.
"""
from __future__ import annotations

import weakref

import torch

from ..linear.fused import fuse
from ..linear.packed import MIN_ROWS, PackedLinear
from ..linear.relayout import layer_layouts
from . import compiled
from .rows import Rows
from .slot_cache import SlotHandle, SlotPool

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")


def supports(model) -> bool:
    """Model types whose decoder layer is exactly: norm, q/k/v (+ optional per-head q/k norm), RoPE, attention
    over every earlier position, o_proj, residual, norm, MLP, residual. Sliding windows, and RoPE variants that
    depend on the sequence length, are left to transformers."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) not in SUPPORTED:
        return False
    window = getattr(cfg, "sliding_window", None)
    if window is not None and getattr(cfg, "use_sliding_window", cfg.model_type == "mistral"):
        return False
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) in ("dynamic", "longrope"):
        # these rescale RoPE from the longest position in the call, which in a batch is another request's
        return False
    inner = getattr(model, "model", None)
    return inner is not None and hasattr(inner, "layers") and hasattr(inner, "rotary_emb")


_POOLS: "weakref.WeakKeyDictionary[torch.nn.Module, SlotPool]" = weakref.WeakKeyDictionary()


def pool_for(model) -> SlotPool:
    """The model's shared cache, kept outside the module so that copying the model does not share or copy it."""
    pool = _POOLS.get(model)
    if pool is None:
        cfg = model.config
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        pool = SlotPool(cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", None) or heads, head_dim,
                        int(getattr(cfg, "max_position_embeddings", 0) or 1 << 20))
        _POOLS[model] = pool
    return pool


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


RELAYOUT_ATTR = "_quantkit_relayout"  # set by read_model(relayout=True): the runtime owns the weight layout
PLAN_ATTR = "_quantkit_step_plan"


class StepPlan:
    """Per model, made once as the runtime loads it (loader.read_model -> attach_plan): each layer's fused q/k/v and
    gate/up calls (linear/fused.py), and the fewest rows a step feeds its products (oneDNN's take their fast
    path from 4 rows: linear/packed.py; padding the step once costs less than padding each of its ~200
    products)."""

    def __init__(self, model):
        self.qkv, self.gate_up = [], []
        self.min_rows = MIN_ROWS if PackedLinear in layer_layouts(model) else 1
        relayout = bool(getattr(model, RELAYOUT_ATTR, False))
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.qkv.append(fuse([attn.q_proj, attn.k_proj, attn.v_proj], relayout))
            self.gate_up.append(fuse([mlp.gate_proj, mlp.up_proj], relayout))

    # The fused calls hold this model's modules: a copy of the model (a draft made by deepcopy, one pickled by
    # torch.save) must not compute with them, so it gets no plan and makes its own at its first step.
    def __deepcopy__(self, memo):
        return None

    def __reduce__(self):
        return _no_plan, ()


def _no_plan():
    return None


def attach_plan(model) -> StepPlan:
    """Build the model's plan and keep it on the model, where the step reads it."""
    # outside inference mode: tensors made here replace module weights, which must stay ordinary tensors
    # (loadable, trainable, writable in place) for whatever else the caller does with the model
    with torch.inference_mode(False), torch.no_grad():
        plan = StepPlan(model)
    setattr(model, PLAN_ATTR, plan)
    return plan


def plan_for(model) -> StepPlan:
    """The plan the loader attached. A model the runtime did not load (a test's own, a copy of a loaded one)
    has none until its first step makes it."""
    plan = getattr(model, PLAN_ATTR, None)
    return plan if plan is not None else attach_plan(model)


def _attend(q, k, v, mask_add, scale):
    """Attention of q [B, H, T, d] over k, v [B, KVH, Lk, d] (heads grouped onto key heads), with an additive
    mask [B, 1, T, Lk]. Two batched products and a softmax: at decode sizes (T <= k+1 rows, a few hundred keys)
    this is several times cheaper on a CPU than SDPA's flash kernel, whose fixed cost dominated."""
    B, H, T, d = q.shape
    kvh = k.shape[1]
    g = H // kvh
    q = q.reshape(B, kvh, g * T, d)
    if torch.compiler.is_compiling():
        # written as broadcast products, inductor fuses scores, softmax and the weighted sum into a few loops
        # instead of calling two tiny batched matmuls per layer (1.4 ms of a 15 ms W4 step)
        scores = (q.unsqueeze(-2) * k.unsqueeze(-3)).sum(-1) * scale
    else:
        scores = (q @ k.transpose(-1, -2)) * scale  # [B, kvh, g*T, Lk]
    scores = scores.view(B, kvh, g, T, -1) + mask_add.unsqueeze(1)
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype).view(B, kvh, g * T, -1)
    if torch.compiler.is_compiling():
        return (probs.unsqueeze(-1) * v.unsqueeze(-3)).sum(-2).view(B, H, T, d)
    return (probs @ v).view(B, H, T, d)


def layers_forward(model, h: torch.Tensor, cos, sin, mask_add, ks, vs, rows, pos, read) -> torch.Tensor:
    """The decoder layers over hidden states h [B, T, D]. ks/vs: per-layer caches [slots, heads, positions, d];
    rows/pos [B, T] where each new key goes; `read` the slot rows to attend over (a slice or an index tensor);
    mask_add [B, 1, T, Lk] holds 0 where a query may look and -inf where it may not."""
    B, T, _ = h.shape
    Lk = mask_add.shape[-1]
    plan = plan_for(model)
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        hd = attn.head_dim
        q, k, v = plan.qkv[i](layer.input_layernorm(h))
        q, k, v = q.view(B, T, -1, hd), k.view(B, T, -1, hd), v.view(B, T, -1, hd)
        if getattr(attn, "q_norm", None) is not None:  # Qwen3 normalises each head before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        q = _rotate(q.transpose(1, 2), cos, sin)
        k = _rotate(k.transpose(1, 2), cos, sin).transpose(1, 2)
        kl, vl = ks[i], vs[i]
        kl[rows, :, pos] = k.to(kl.dtype)  # indices around a slice: the indexed shape is [B, T, heads, d], as k's
        vl[rows, :, pos] = v.to(vl.dtype)
        kc = kl[read, :, :Lk].to(q.dtype)
        vc = vl[read, :, :Lk].to(q.dtype)
        o = _attend(q, kc, vc, mask_add, attn.scaling)
        h = h + attn.o_proj(o.transpose(1, 2).reshape(B, T, -1))
        gate, up = plan.gate_up[i](layer.post_attention_layernorm(h))
        h = h + layer.mlp.down_proj(layer.mlp.act_fn(gate) * up)
    return h


@torch.inference_mode()  # the pool's tensors are written in place by every caller, so all of them run here
def forward_batch(model, items: list[tuple[SlotHandle, torch.Tensor]], last_only: bool) -> list["Rows"]:
    """Logits per item (rows.Rows): [n_i, V] for every fed token, or [1, V] for the last one when last_only."""
    pool = pool_for(model)
    inner = model.model
    emb = inner.embed_tokens
    device = emb.weight.device
    with pool.lock:
        order = sorted(range(len(items)), key=lambda j: items[j][0].slot if items[j][0].slot >= 0 else 1 << 30)
        handles = [items[j][0] for j in order]
        feeds = [items[j][1] for j in order]
        n = [f.shape[0] for f in feeds]
        B, T = len(feeds), max(n)
        T = max(T, -(-plan_for(model).min_rows // B))  # extra positions are padding, as in any ragged row
        lengths = torch.tensor([hd.length for hd in handles], dtype=torch.long)
        need = int(lengths.max()) + T
        dtype = emb.weight.dtype
        pool.prepare(handles, need, dtype, device)
        ids = torch.zeros(B, T, dtype=torch.long)
        for b, f in enumerate(feeds):
            ids[b, : n[b]] = f
        pos = lengths[:, None] + torch.arange(T)[None, :]
        slots = torch.tensor([hd.slot for hd in handles], dtype=torch.long)
        rows = slots[:, None].expand(B, T)
        first = int(slots[0])
        contiguous = bool(torch.equal(slots, torch.arange(first, first + B)))
        read = slice(first, first + B) if contiguous else slots.to(device)
        visible = (torch.arange(need)[None, None, :] <= pos[:, :, None]).unsqueeze(1)
        mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))
        h = emb(ids.to(device))
        cos, sin = inner.rotary_emb(h, pos.to(device))
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        step = compiled.step(model, "slot")
        fn = step if step is not None and T <= 16 and all(hd.length for hd in handles) else layers_forward
        h = fn(model, h, cos, sin, mask.to(device), pool.k, pool.v, rows.to(device), pos.to(device), read)
        for hd, m in zip(handles, n):
            hd.length += m
    head = model.get_output_embeddings()
    eager = [b for b in range(B) if last_only or n[b] == 1]  # one row each: one batched head call for them all
    rows_of = {b: [n[b] - 1] if last_only else list(range(n[b])) for b in range(B)}
    out: list[Rows | None] = [None] * len(items)
    if eager:
        logits = head(inner.norm(h[[b for b in eager for _ in rows_of[b]], [t for b in eager for t in rows_of[b]]]))
        start = 0
        for b in eager:
            out[order[b]] = Rows(logits[start: start + len(rows_of[b])])
            start += len(rows_of[b])
    for b in range(B):
        if out[order[b]] is None:  # a verify row: its head waits until the draft is checked (rows.Rows)
            out[order[b]] = Rows(hidden=inner.norm(h[b, : n[b]]), head=head)
    return out
