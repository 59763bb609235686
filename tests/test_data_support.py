"""Shared builders for the data tests (no tests here): a real BPE tokenizer trained in-process on the
sample prose, and a tiny random llama sized to it. Hub downloads are impossible in tests, so nothing is
fetched."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
SAMPLE = DATA / "calib_sample.txt"

CHAT_TEMPLATE = ("{% for m in messages %}{{ bos_token }}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}\n"
                 "{% endfor %}")


@lru_cache(maxsize=None)
def tiny_tokenizer(add_bos: bool = True, chat: bool = True):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator([SAMPLE.read_text()], trainer=trainer)
    if add_bos:  # like llama: BOS before every encoded text
        tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    if chat:
        tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_llama(vocab_size: int, seed: int = 0):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def one_thread():
    """Generator body for an autouse fixture: torch's two OpenMP threads spin against other processes on
    this shared 2-core machine and slow tiny models down ~50x; one thread is fast and deterministic."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
