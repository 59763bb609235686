"""Shared builders for the eval tests (no tests here): a BPE tokenizer trained in-process on the sample
prose, tiny random llama folders saved with it, a perturbed copy, a task file and a text file."""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import torch

DATA = Path(__file__).resolve().parent / "data"
SAMPLE = DATA / "calib_sample.txt"


@lru_cache(maxsize=None)
def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator([SAMPLE.read_text()], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def tiny_model(seed: int = 0, hidden: int = 64):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=len(tokenizer()), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, eos_token_id=2, bos_token_id=1, pad_token_id=0,
                      tie_word_embeddings=False, initializer_range=0.2)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def save(model, folder: Path) -> Path:
    model.save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    return folder


def perturbed(model, scale: float, seed: int = 1):
    """A copy with seeded Gaussian noise of `scale` x each weight's std added to every Linear weight."""
    import copy

    g = torch.Generator().manual_seed(seed)
    m = copy.deepcopy(model)
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, torch.nn.Linear):
                w = mod.weight
                w += torch.randn(w.shape, generator=g) * w.std() * scale
    return m


TASKS = [
    {"id": "a1", "task": "arithmetic", "prompt": "The tokens of a model", "answer": "are"},
    {"id": "a2", "task": "arithmetic", "prompt": "Quantisation changes", "answer": "answers"},
    {"id": "a3", "task": "arithmetic", "prompt": "Calibration data is", "answer": "text"},
    {"id": "c1", "task": "copy", "prompt": "Repeat: the model. Again: the", "answer": "model"},
    {"id": "c2", "task": "copy", "prompt": "Layer by layer", "answer": None},
    {"id": "f1", "task": "facts", "prompt": "A weight is", "answer": "a number"},
]


def task_file(folder: Path) -> Path:
    p = folder / "tasks.jsonl"
    p.write_text("".join(json.dumps({k: v for k, v in t.items() if v is not None}) + "\n" for t in TASKS))
    return p


def text_file(folder: Path) -> Path:
    p = folder / "text.txt"
    p.write_text(SAMPLE.read_text())
    return p
