"""config.json against the weights, before anything is allocated.

A config that does not describe the safetensors beside it (a default `{"model_type": "llama"}` next to a small
model, a wrong hidden_size) would otherwise make from_pretrained build the model the config describes at full
size, which can be killed for memory with no message, or fail pointing at a load report it never printed.
"""
from __future__ import annotations

from pathlib import Path

from torch import nn

from ..errors import UserError
from ..formats.safetensors_header import read_header


def safetensors_shapes(src: Path) -> dict[str, tuple[int, ...]] | None:
    """{tensor key: shape} from the headers of SRC's safetensors files; None when there are none. A file that is
    corrupt or cut short is a UserError here, before anything else reads it."""
    files = sorted(src.glob("*.safetensors"))
    if not files:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        head = read_header(f)
        shapes.update({k: tuple(v["shape"]) for k, v in head.items() if k != "__metadata__"})
    return shapes


def _fmt(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def check_weights_match(src: Path, meta_model: nn.Module) -> None:
    """Raise a UserError when META_MODEL (built from config.json on the meta device) cannot hold SRC's weights."""
    shapes = safetensors_shapes(src)
    if shapes is None:
        return  # not safetensors (a .bin checkpoint): transformers' own checks apply
    expected = {k: tuple(t.shape) for k, t in meta_model.state_dict().items()}
    common = [k for k in expected if k in shapes]
    wrong = [k for k in common if expected[k] != shapes[k]]
    if wrong:
        k = wrong[0]
        raise UserError(f"config.json in '{src}' does not match its weights: {k} is {_fmt(shapes[k])} in the "
                        f"safetensors files but the config makes it {_fmt(expected[k])} ({len(wrong)} of "
                        f"{len(common)} tensors differ); fix config.json or re-save the model with save_pretrained")
    if set(shapes) <= set(expected):  # the names line up one to one, so a missing one is really missing
        tied = _tied_keys(meta_model)
        missing = [k for k in expected if k not in shapes and k not in tied]
        if missing:
            raise UserError(f"the safetensors files in '{src}' lack {missing[0]}"
                            f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}, which config.json's "
                            "model needs (a missing shard, or num_hidden_layers too large); fix config.json or "
                            "re-save the model with save_pretrained")


def _tied_keys(model: nn.Module) -> set[str]:
    """State-dict keys that alias another entry (a tied head), which a checkpoint stores once."""
    seen: dict[int, str] = {}
    tied = set()
    for k, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            tied.add(k)
        else:
            seen[id(t)] = k
    return tied
