"""From command-line choices to runtime objects besides the model (quantkit.load, runtime/checkpoint.py): its
tokenizer, threads, compilation.

Drafters are chosen one layer up (quantkit/drafts), since a self-draft is made by quantising."""
from __future__ import annotations

import os
import types
from pathlib import Path

import torch

from ..errors import UserError


def set_threads(n: int | None) -> None:
    """Intra-op threads for CPU decoding. Batch-1 decode of a small model is per-op overhead, and on a machine
    whose cores are busy, OpenMP's spinning threads made it 5-50x slower than one thread (docs/benchmarks.md)."""
    if n is not None:
        if n < 1:
            raise UserError(f"--threads must be at least 1, got {n}")
        torch.set_num_threads(n)


STAYS_EAGER_NOTE = ("note: --compile leaves this model eager: its float32 products are oneDNN calls on pre-laid "
                    "weights, which a compiled graph would only slow down")


def compile_decode(model):
    """torch.compile the decode step (`--compile`), with dynamic shapes so that the growing cache and the varying
    number of verified tokens do not recompile. Prefills stay eager (forward.forward, llama_step.forward_batch):
    a fresh cache's lazy per-layer set-up would otherwise recompile at every new request. On a CPU this removes
    much of the per-op overhead, which dominates a W4 decode step (docs/benchmarks.md); in float32 the matmuls
    dominate and it gains little. The first decode step compiles (about a minute on 2 cores), so it is
    opt-in. Outputs equal the eager model's up to float summation order.

    A model with Linears in oneDNN's layout (linear/packed.py, the runtime's float32 CPU models) stays eager:
    those products are single library calls a compiled graph cannot fuse with anything, and through a custom op
    each cost ~30 us more, which over 211 calls made a step slower than eager (15.4 vs 19.5 tok/s). FBGEMM's
    float16-weight products (linear/half_weight.py) reach the graph as one light op each, and compiling the glue
    between them takes the float16-held SmolLM2 from 42.7 to 51.8 tok/s (docs/benchmarks.md).
    Returns whether anything was compiled."""
    from . import compiled
    from .llama_step import layers_forward
    from ..linear.packed import PackedLinear
    from ..linear.relayout import layer_layouts

    if PackedLinear in layer_layouts(model):
        return False

    _inductor_cache_per_capability()
    compiled.set_step(model, "decode", torch.compile(model.forward, dynamic=True))  # transformers' path
    compiled.set_step(model, "slot", torch.compile(_own_copy(layers_forward, model), dynamic=True,
                                                   options={"guard_filter_fn": _fixed_model_guards}))
    return True


def _inductor_cache_per_capability() -> None:
    """Compiled kernels kept apart for each ATen CPU capability (ATEN_CPU_CAPABILITY caps it). torch 2.13's
    inductor cache does not tell them apart: a process capped to AVX2 that loaded kernels compiled uncapped
    computed logits off by 1e19, and the other way round corrupted the heap (free(): invalid pointer). A cache
    folder the user chose (TORCHINDUCTOR_CACHE_DIR) is left as it is; torch writes its default there on first use."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from ..cache_dir import cache_root

    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen and os.path.abspath(chosen) != os.path.abspath(default_cache_dir()):
        return
    capability = torch.backends.cpu.get_cpu_capability().lower()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_root() / f"inductor-{capability}")


def _own_copy(fn, model):
    """`fn` under a code object of its own. Dynamo keeps compiled graphs per code object, and with the module
    guards skipped (below) a graph compiled for one model would be reused for another of the same shapes,
    computing with the first model's weights; one code object per model keeps each model's graphs apart."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{id(model):x}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def _fixed_model_guards(entries):
    """Guards worth checking on each compiled step: those on its tensor arguments. The modules and the per-model
    plan (fused packs, an attribute of the model: llama_step.attach_plan) do not change while a model serves,
    and re-checking their ~2500 guards cost about 1.7 ms of a 14 ms W4 step on this CPU."""
    modules = torch.compiler.skip_guard_on_all_nn_modules_unsafe(entries)
    globals_ = torch.compiler.skip_guard_on_globals_unsafe(entries)
    return [a and b for a, b in zip(modules, globals_)]


# Any of these makes a folder loadable by AutoTokenizer (fast, sentencepiece, BPE, WordPiece, tiktoken).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spiece.model", "vocab.json",
                   "vocab.txt", "merges.txt")


def _copy_tokenizer_hint(path: str) -> str:
    """How to give PATH a tokenizer, naming the model it was quantised from when quantkit.json records it."""
    from ..formats.json_files import read_json_object

    try:
        source = read_json_object(Path(path) / "quantkit.json", "").get("source_model")
    except UserError:
        source = None
    origin = f"'{source}'" if isinstance(source, str) and source else "the original model folder"
    return f"copy tokenizer.json and tokenizer_config.json from {origin} into '{path}'"


def _check_tokenizer_files(path: str) -> None:
    folder = Path(path)
    if any((folder / n).is_file() for n in TOKENIZER_FILES) or any(folder.glob("*.tiktoken")):
        return
    raise UserError(f"'{path}' has no tokenizer files (tokenizer.json, tokenizer_config.json, ...); "
                    f"{_copy_tokenizer_hint(path)}")


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    from .checkpoint import resolve_path
    from .loader import read_config

    path = resolve_path(path)
    if (Path(path) / "config.json").exists():
        read_config(Path(path))  # transformers reads it too, and would fail in its own words
    _check_tokenizer_files(path)
    try:
        return AutoTokenizer.from_pretrained(path)
    # transformers and tokenizers raise many types here (OSError, ValueError, ImportError for a missing
    # sentencepiece, tokenizers' bare Exception for a bad tokenizer.json); every one means the files are unusable.
    except Exception as e:  # noqa: BLE001
        detail = " ".join(str(e).split())[:200]
        raise UserError(f"the tokenizer in '{path}' does not load ({type(e).__name__}: {detail}); "
                        f"{_copy_tokenizer_hint(path)}") from None
