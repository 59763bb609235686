"""Self-calibration that fits: when the float model does not fit the memory quantkit is given, a round-to-nearest
copy samples the calibration text instead: W8 where it fits, else W4.

A 70B in bfloat16 is 141 GB; its W8 copy about 70 GB, its W4 copy about 40 GB. The copy is built while the decoder
layers stream from disk one at a time (models/lazy.py): each layer is read in float, its Linears rounded (RTN,
symmetric; 8 bits per output channel, or 4 bits in groups of 128 or the largest of 64/32 dividing the width, as
the self-draft does) into the packed QuantLinear a loaded checkpoint runs with, and the float weights dropped;
norms stay in the compute dtype, and the embeddings and head are the lazily opened model's own tensors, shared rather than copied. data/selfgen samples from the copy, which is
freed before the float layers stream again for the real quantisation.

Why W8 first: the text is what the float model's solvers calibrate on, and a W4 copy writes text the float model
would not. SmolLM2-135M's default (AWQ) on 8 x 128 tokens sampled under cpu=448MiB scored +1.44% perplexity above
the float-sampled run on held-out prose (+1.86% on 16 x 256), a W8 copy's text +1.23% over five seeds (2-core AMD
EPYC, 2026-12-04). Each sample's first token is the float model's pick, its layers streamed for that one forward
(models/streamed_forward.py): with it the W8 copy's text scored -0.36% (mean of five seeds, each within 1%).

Sampling holds the sampling model and, per row sampled at once, that row's KV cache at full length and the
sampler's work on its next-token logits (row_bytes), plus SAMPLING_MARGIN of the whole for the allocator. The
float model samples when that fits one row beside it in the cap on the host (`--max-memory`'s entry for cpu,
else the host's available memory); the rows sampled at once are as many as fit, at most selfgen's batch.
"""
from __future__ import annotations

import gc

import torch
from torch import nn

from .. import distributed, heap
from ..data.selfgen import DEFAULTS as SAMPLER
from ..devices import proc_kib
from ..errors import UserError
from ..kernels import dispatch
from ..linear.quant import QuantLinear
from ..models.hf import meta_model
from ..models.lazy import LazyWeights
from ..models.streamed_forward import StreamedForward
from ..recipe.memory_cap import cap_for, parse_max_memory
from ..schemes import fitting_group_size, get_scheme
from ..solvers.rtn import rtn_quantize

SAMPLING_MARGIN = 0.10
GROUP = 128
COPY_BITS = (8, 4)  # the most bits that fit
# bytes a weight takes in the copy: its codes, half a byte at 4 bits and one at 8, on either device (on a CPU the
# repack torch's int4/int8 op runs on is the codes, and the checkpoint-layout words are let go layer by layer,
# _repacked_only); the scales (one per group or row) are counted apart
_CODE_BYTES = {4: 0.5, 8: 1.0}
# numbers per vocabulary entry the sampler holds for a row's next token: logits, probabilities, their sorted
# copy, its order (int64: two), cumulative sums and the kept mass (selfgen._top_p_sample)
_SAMPLER_NUMBERS = 7


def float_bytes(model: nn.Module) -> int:
    """The model's weights in the dtype it computes in (meta tensors count what they would hold)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def free_bytes(device: str) -> int:
    """What DEVICE has free now: the host's MemAvailable, or the GPU's free memory."""
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[0]
    available = proc_kib("/proc/meminfo", "MemAvailable")
    if available is not None:
        return available
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def given_cap(max_memory: str | None, device: str) -> int | None:
    """--max-memory's cap on DEVICE, None where it gives none."""
    return cap_for(parse_max_memory(max_memory), device) if max_memory else None


def cap_bytes(max_memory: str | None, device: str) -> int:
    """The cap on DEVICE: --max-memory's entry for it, else what it has free."""
    cap = given_cap(max_memory, device)
    return free_bytes(device) if cap is None else cap


def row_bytes(model: nn.Module, seq_len: int) -> int:
    """What one row sampled at once adds: its KV cache at SEQ_LEN tokens, in the model's dtype, and the
    sampler's float32 work on its next-token logits."""
    text = model.config.get_text_config()
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    size = next(model.parameters()).element_size()
    vocab = model.get_output_embeddings().weight.shape[0]
    return text.num_hidden_layers * 2 * kv_heads * head_dim * seq_len * size + _SAMPLER_NUMBERS * 4 * vocab


def rows_that_fit(held: int, row: int, cap: int) -> int:
    """Rows sampled at once beside HELD bytes of model, at most selfgen's batch; 0 when not even one fits.
    Every rank samples the same text, so every rank takes the fewest any of them can afford."""
    rows = int((cap / (1 + SAMPLING_MARGIN) - held) // row)
    return distributed.least(max(0, min(SAMPLER["batch_size"], rows)))


def float_fits(model: nn.Module, max_memory: str | None, seq_len: int) -> bool:
    """Whether the whole float model may be loaded to sample: with at least one row beside it."""
    return rows_that_fit(float_bytes(model), row_bytes(model, seq_len), cap_bytes(max_memory, "cpu")) > 0


def float_rows(model: nn.Module, max_memory: str | None, seq_len: int) -> int:
    """Rows the loaded float MODEL samples at once (float_fits said one fits): beside it within --max-memory,
    or within what the host has free now that it is loaded."""
    cap = given_cap(max_memory, "cpu")
    held = 0 if cap is None else float_bytes(model)
    return max(1, rows_that_fit(held, row_bytes(model, seq_len), cap_bytes(max_memory, "cpu")))


def copy_name(bits: int) -> str:
    return f"rtn-w{bits} copy"


def sampling_record(model: nn.Module, max_memory: str | None, copy_bits: int | None) -> dict:
    """quantkit.json's note of which model wrote the calibration text (the float model, or the copy of COPY_BITS),
    and under which cap."""
    return {"model": copy_name(copy_bits) if copy_bits else "float", "max_memory": max_memory or "free host memory",
            "float_bytes": float_bytes(model), "margin": SAMPLING_MARGIN,
            "openings": "float, layer by layer" if copy_bits else "float"}


def copy_bytes(model: nn.Module, layers_name: str, bits: int) -> int:
    """What sampling from the copy of BITS holds on its device: the decoder layers' Linears as codes and scales,
    their other tensors in float, and the embeddings and head (on the host the opened model's own, on a GPU a
    copy)."""
    code = _CODE_BYTES[bits]
    total = 0
    for name, p in model.named_parameters():
        mod = model.get_submodule(name.rpartition(".")[0])
        linear = name.startswith(f"{layers_name}.") and type(mod) is nn.Linear and name.endswith(".weight")
        scales = p.element_size() / (GROUP if bits == 4 else p.shape[-1]) if linear else 0
        total += int(p.numel() * (code + scales)) if linear else p.numel() * p.element_size()
    return total


def held_beside(model: nn.Module, since: int | None) -> int:
    """Anonymous memory the run holds on the host beyond the opened model's real tensors, counted from SINCE
    (RssAnon when the job started): the tokenizer (121 MiB for SmolLM2's), the lazily opened skeleton, what the
    allocator kept. 0 where /proc cannot say."""
    now = proc_kib("/proc/self/status", "RssAnon")
    if since is None or now is None:
        return 0
    tensors = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()] if not t.is_meta)
    return max(0, now - since - tensors)


def copy_that_fits(model: nn.Module, layers_name: str, device: str, max_memory: str | None, seq_len: int,
                   held: int = 0) -> tuple[int, int, int]:
    """(bits, rows sampled at once, bytes held) of the copy with the most bits that fits with one row beside it,
    in the cap less HELD (what the run already holds beside the model on DEVICE, under a cap it was given);
    bits 0 when none does."""
    given = given_cap(max_memory, device)
    cap = free_bytes(device) if given is None else given - held
    row = row_bytes(model, seq_len)
    for bits in COPY_BITS:
        need = copy_bytes(model, layers_name, bits)
        rows = rows_that_fit(need, row, cap)
        if rows:
            return bits, rows, need
    return 0, 0, need


def sample_with_rtn_copy(model: nn.Module, weights: LazyWeights, device: str, max_memory: str | None, seq_len: int,
                         sample, held: int = 0):
    """(sample(copy, rows, openings), bits) with an RTN copy of the lazily opened MODEL on DEVICE, of the most bits
    that fit the cap, rows being how many are sampled at once within it and openings the float model streamed
    layer by layer (whose next-token distribution picks each sample's first token: models/streamed_forward.py);
    the copy is freed again before returning."""
    bits, rows, need = copy_that_fits(model, weights.layers_name, device, max_memory, seq_len, held)
    if rows == 0:
        raise UserError(f"neither the float model ({float_bytes(model) / 2**30:.2f} GiB) nor its W4 copy "
                        f"({need / 2**30:.2f} GiB) with a {seq_len}-token KV cache fits in "
                        f"{max_memory or 'the free memory'} on {device} to sample calibration text; raise "
                        "--max-memory or calibrate on a dataset (--calib wikitext2 or a file)")
    copy = _build(model, weights, device, bits)
    try:
        return sample(copy, rows, StreamedForward(weights)), bits
    finally:
        del copy
        gc.collect()
        heap.trim()


def _build(model: nn.Module, weights: LazyWeights, device: str, bits: int) -> nn.Module:
    dtype = next(model.parameters()).dtype
    copy = meta_model(model.config, dtype)
    copy.generation_config = model.generation_config
    streamed = LazyWeights(copy, weights.files, weights.sources)
    _share_outside_layers(model, copy, streamed, device)
    for i, layer in enumerate(streamed.layers):
        streamed.load_layer(i)
        prefix = f"{streamed.layers_name}.{i}"
        names = [f"{prefix}.{n}" for n, m in layer.named_modules() if type(m) is nn.Linear]
        for name in names:
            q = _rounded(copy.get_submodule(name), dtype, bits)
            if device == "cpu":
                _repacked_only(q)
            copy.set_submodule(name, q)
            # rounding one Linear leaves 40-50 MiB of temporaries (SmolLM2's 576 x 1536) as heap blocks glibc keeps
            # (heap.py); left to pile up over a layer's seven, the W8 copy's build peaked 104 MiB above what the
            # copy ends up holding, over a 448 MiB cap
            heap.trim()
        streamed.release(names)  # the float weights, still held by the replaced Linears' slots
        layer.to(device)
    return copy.to(device).eval()


def _share_outside_layers(model: nn.Module, copy: nn.Module, streamed: LazyWeights, device: str) -> None:
    """Embeddings, final norm and head: the opened model's tensors, in new Parameters (so moving the copy never
    moves the original) over the same storage on the host."""
    held = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    inside, done = f"{streamed.layers_name}.", set()
    for key, slots in streamed.slots.items():
        if key in done or key.startswith(inside) or key not in held or held[key].is_meta:
            continue
        done.update(streamed.aliases[key])  # a tied head is the embedding: one Parameter for both
        t = held[key].detach().to(device)
        shared = nn.Parameter(t, requires_grad=False) if slots[0][1] in slots[0][0]._parameters else t
        for mod, leaf in slots:
            (mod._parameters if leaf in mod._parameters else mod._buffers)[leaf] = shared


def _repacked_only(q: QuantLinear) -> None:
    """On a CPU the copy runs every Linear through torch's int4 or int8 op, on the repacked weight `prepare` builds; the
    checkpoint-layout words are then never read again, so they are let go here, layer by layer, instead of being
    held beside the repack for the whole sampling (measured: the first forward repacked every Linear of SmolLM2's
    copy at once; a 70B copy would hold its ~35 GB twice). Kept where a kernel is forced (QUANTKIT_KERNEL)."""
    if dispatch.forced_kernel() is not None:
        return
    dispatch.prepare(q)
    if q._cpu_int4 is not None or q._cpu_int8 is not None:
        q.weight_packed = torch.empty(0, dtype=torch.int32)


def _rounded(linear: nn.Linear, dtype: torch.dtype, bits: int) -> QuantLinear:
    if bits == 8:  # per output channel: torch's int8 op takes one scale per row
        scheme = get_scheme("w8a16").with_options(group_size=-1)
    else:
        gs = fitting_group_size([linear.in_features], GROUP) or -1
        scheme = get_scheme("w4a16").with_options(group_size=gs, full_range=True)
    qw = rtn_quantize(linear.weight.detach(), scheme, scale_dtype=dtype)
    return QuantLinear.from_qweight(qw, linear.bias, dtype)
