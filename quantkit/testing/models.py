"""Tiny random llama models for tests and benchmarks: seconds to build, deterministic for a given seed."""
from __future__ import annotations

import contextlib

import torch


def tiny_llama(vocab_size: int = 256, hidden: int = 64, layers: int = 2, seed: int = 0, max_positions: int = 512,
               dtype=torch.float32, eos_token_id=None, init_std: float = 0.02):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max_positions, eos_token_id=eos_token_id, bos_token_id=None,
                      pad_token_id=None, initializer_range=init_std, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    model.generation_config.eos_token_id = eos_token_id
    model.generation_config.pad_token_id = 0
    return model


@contextlib.contextmanager
def single_thread():
    """Tiny models are all per-op overhead: extra intra-op threads only add synchronisation (20x slower on a
    busy 2-core machine, measured), so tests that run them many times use one thread."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
