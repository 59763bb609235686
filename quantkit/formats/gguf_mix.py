"""Which llama.cpp type each tensor gets under a GGUF scheme: our own table of the rules `llama-quantize`
applies for these mixes (src/llama-quant.cpp, llama_tensor_get_type, for dense non-Falcon models without
an importance matrix), so a quantkit q4_k_m file has the same type per tensor as llama.cpp's."""
from __future__ import annotations

from ..errors import UserError
from .gguf_blocks import TYPES

# scheme -> (the type most tensors get, llama.cpp's general.file_type number for the mix)
SCHEMES = {
    "q4_0": ("Q4_0", 2), "q4_1": ("Q4_1", 3), "q8_0": ("Q8_0", 7), "q6_k": ("Q6_K", 18),
    "q3_k_m": ("Q3_K", 12), "q4_k_m": ("Q4_K", 15), "q5_k_m": ("Q5_K", 17),
    "f16": ("F16", 1),  # no quantisation: the float file llama.cpp's own llama-quantize starts from
}
# a k-quant whose rows the 256-value super-block does not divide falls back to a 32-value type
_FALLBACK = {"Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def check_scheme(scheme: str) -> str:
    s = scheme.lower()
    if s not in SCHEMES:
        raise UserError(f"--scheme {scheme} is not a GGUF scheme; with --format gguf use one of {', '.join(SCHEMES)}")
    return s


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's layers that get a bigger type in the _M mixes: the first and last eighth, every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _by_role(scheme: str, base: str, role: str, layer: int, n_layers: int) -> str:
    if role == "output":
        return "Q8_0" if base == "Q8_0" else "Q6_K"
    if role == "attn_v":
        if scheme == "q3_k_m":
            return "Q5_K" if layer < 2 else "Q4_K"
        if scheme in ("q4_k_m", "q5_k_m") and _more_bits(layer, n_layers):
            return "Q6_K"
    if role == "ffn_down":
        if scheme == "q3_k_m":
            return "Q5_K" if layer < n_layers // 16 else "Q4_K"
        if scheme in ("q4_k_m", "q5_k_m") and _more_bits(layer, n_layers):
            return "Q6_K"
    if role == "attn_output" and scheme == "q3_k_m":
        return "Q4_K"
    return base


def tensor_type(scheme: str, role: str, layer: int, n_layers: int, cols: int) -> str:
    """The type for one weight: role is output (also the token embedding of a tied model), token_embd,
    attn_q, attn_k, attn_v, attn_output, ffn_gate, ffn_up or ffn_down; cols its row length."""
    if scheme == "f16":
        return "F16"
    t = _by_role(scheme, SCHEMES[scheme][0], role, layer, n_layers)
    if cols % TYPES[t].block:
        t = _FALLBACK.get(t, t)
    if cols % TYPES[t].block:
        return "F16"
    return t
