"""A GGUF file for llama.cpp from a Hugging Face Llama-family or Qwen2 folder: the architecture's metadata
keys, the GPT-2-style BPE tokenizer from tokenizer.json, and tensors under llama.cpp's names, each either
float (norms, biases) or the bytes of a block type. The container itself is the `gguf` package's GGUFWriter.

llama.cpp's `llama` architecture rotates adjacent pairs of each head's q/k rows (its converter interleaves
Hugging Face's halves: permute_qk); `qwen2` rotates halves as Hugging Face does (rows as they are) and adds
q/k/v biases."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from ..errors import UserError

# Hugging Face model_type -> llama.cpp architecture
ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
    "self_attn.q_proj.weight": "attn_q", "self_attn.k_proj.weight": "attn_k", "self_attn.v_proj.weight": "attn_v",
    "self_attn.o_proj.weight": "attn_output", "mlp.gate_proj.weight": "ffn_gate", "mlp.up_proj.weight": "ffn_up",
    "mlp.down_proj.weight": "ffn_down",
    "self_attn.q_proj.bias": "attn_q", "self_attn.k_proj.bias": "attn_k", "self_attn.v_proj.bias": "attn_v",
}
_TOP_NAMES = {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm", "lm_head.weight": "output"}


def gguf_name(hf_name: str) -> tuple[str, int] | None:
    """(llama.cpp's role name, layer index or -1) for a Hugging Face Llama tensor name; None: not written
    (rotary caches)."""
    m = _LAYER.match(hf_name)
    if m:
        role = _LAYER_NAMES.get(m.group(2))
        return (role, int(m.group(1))) if role else None
    role = _TOP_NAMES.get(hf_name)
    return (role, -1) if role else None


def tensor_key(role: str, layer: int, hf_name: str = "") -> str:
    kind = "bias" if hf_name.endswith(".bias") else "weight"
    return f"{role}.{kind}" if layer < 0 else f"blk.{layer}.{role}.{kind}"


def arch(config) -> str:
    return ARCHITECTURES[config.model_type]


def rotates_pairs(config) -> bool:
    """Whether llama.cpp's architecture wants q/k rows interleaved (permute_qk)."""
    return arch(config) == "llama"


def permute_qk(w, heads: int):
    """llama.cpp's rotary pairs are adjacent rows, Hugging Face's are half a head apart: interleave the halves."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def check_config(config) -> None:
    if config.model_type not in ARCHITECTURES:
        raise UserError(f"GGUF export writes {', '.join(ARCHITECTURES)} models; this model is "
                        f"'{config.model_type}': use the default compressed-tensors format for it")
    if getattr(config, "use_sliding_window", False):
        raise UserError("GGUF export writes full attention only (this model uses a sliding window); use the "
                        "compressed-tensors format for it")
    if _rope(config).get("rope_type", "default") != "default":
        raise UserError("GGUF export writes plain RoPE only (no rope scaling yet); use the compressed-tensors "
                        "format for this model")


def _rope(config) -> dict:
    """transformers 5's rope_parameters, or the older rope_scaling plus rope_theta."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def _metadata(w, config, file_type: int, name: str) -> None:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    w.add_name(name)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_hidden_layers)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(float(_rope(config)["rope_theta"]))
    w.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    w.add_vocab_size(config.vocab_size)
    w.add_file_type(file_type)
    w.add_quantization_version(2)


# Qwen2's split before byte-level encoding (its tokenizer.json, verbatim), which llama.cpp knows as "qwen2"
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")


def _pre_tokenizer(tok: dict) -> str:
    """llama.cpp's name for the pre-tokenizer: SmolLM's single digits then GPT-2 byte level, GPT-2's own, or
    Qwen2's split then byte level."""
    pre = tok.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [(p.get("type"), p.get("individual_digits")) for p in parts]
    if kinds == [("Digits", True), ("ByteLevel", None)]:
        return "smollm"
    if kinds == [("ByteLevel", None)]:
        return "gpt-2"
    split = (parts[0].get("pattern") or {}).get("Regex")
    if kinds == [("Split", None), ("ByteLevel", None)] and split == _QWEN2_SPLIT:
        return "qwen2"
    raise UserError("GGUF export knows the GPT-2, SmolLM and Qwen2 byte-level pre-tokenizers only; this "
                    "tokenizer.json has another: use the compressed-tensors format for this model")


def _tokenizer(w, src: Path, config) -> None:
    import gguf

    path = src / "tokenizer.json"
    if not path.is_file():
        raise UserError(f"{src} has no tokenizer.json; GGUF export needs the fast (BPE) tokenizer saved beside the model")
    tok = json.loads(path.read_text())
    if tok.get("model", {}).get("type") != "BPE":
        raise UserError("GGUF export writes BPE tokenizers only; this tokenizer.json is not BPE")
    vocab = dict(tok["model"]["vocab"])
    added = {a["content"]: a for a in tok.get("added_tokens", [])}
    vocab.update({c: a["id"] for c, a in added.items()})
    size = max(config.vocab_size, max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [gguf.TokenType.UNUSED] * size
    for text, i in vocab.items():
        tokens[i] = text
        a = added.get(text)
        types[i] = gguf.TokenType.NORMAL if a is None else (
            gguf.TokenType.CONTROL if a.get("special") else gguf.TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"].get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(_pre_tokenizer(tok))
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    _special_tokens(w, src, config, vocab)


def _special_tokens(w, src: Path, config, vocab: dict) -> None:
    cfg_path = src / "tokenizer_config.json"
    tc = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}

    def token_id(key):
        v = tc.get(key)
        v = v.get("content") if isinstance(v, dict) else v
        return vocab.get(v) if v is not None else None

    bos = token_id("bos_token") if token_id("bos_token") is not None else getattr(config, "bos_token_id", None)
    eos = token_id("eos_token") if token_id("eos_token") is not None else getattr(config, "eos_token_id", None)
    for value, add in ((bos, w.add_bos_token_id), (eos, w.add_eos_token_id), (token_id("unk_token"), w.add_unk_token_id),
                       (token_id("pad_token"), w.add_pad_token_id)):
        if isinstance(value, int):
            add(value)
    w.add_add_bos_token(bool(tc.get("add_bos_token", False)))
    if isinstance(tc.get("chat_template"), str):
        w.add_chat_template(tc["chat_template"])


class GGUFFile:
    """Collects tensors, then writes header, metadata and data in one pass (GGUFWriter's order)."""

    def __init__(self, path: Path, src: Path, config, file_type: int, name: str):
        import gguf

        self._gguf = gguf
        self.writer = gguf.GGUFWriter(str(path), arch(config))
        _metadata(self.writer, config, file_type, name)
        _tokenizer(self.writer, src, config)

    def add_float(self, key: str, values: np.ndarray, f16: bool = False) -> None:
        self.writer.add_tensor(key, values.astype(np.float16 if f16 else np.float32))

    def add_blocks(self, key: str, raw: np.ndarray, type_name: str) -> None:
        self.writer.add_tensor(key, raw, raw_dtype=self._gguf.GGMLQuantizationType[type_name])

    def close(self) -> None:
        self.writer.write_header_to_file()
        self.writer.write_kv_data_to_file()
        self.writer.write_tensors_to_file()
        self.writer.close()
