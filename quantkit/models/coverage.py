"""Which weights a plan leaves in float, and whether that is a silent failure.

A plan is built over nn.Linear modules. A weight held by anything else (fused experts quantkit cannot split,
GPT-2 Conv1D, an unknown 3-D parameter) would be written in float while the checkpoint claims to be W4, so
quantise lists every such weight at plan time and stops when they hold more than a few percent of the model,
unless the user ignores them by name. Embeddings (a lookup, never a matmul) and norms/biases (vectors) are
expected to stay float and are not counted here.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..errors import UserError
from ..targets import matches

# above this share of the model's matrix parameters, an uncovered weight stops the run
MAX_UNCOVERED_SHARE = 0.02


@dataclass
class Uncovered:
    name: str  # parameter name
    numel: int
    module_type: str


def uncovered_weights(model: nn.Module, planned: set[str], ignore: list[str]) -> list[Uncovered]:
    """Matrix parameters (2-D and up) that no planned Linear holds, the embeddings and ignored modules aside."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    out, seen = [], set()
    for mod_name, mod in model.named_modules():
        for leaf, p in mod.named_parameters(recurse=False):
            if p.dim() < 2 or id(p) in seen or id(p) in embeddings:
                continue
            seen.add(id(p))
            if mod_name in planned or any(matches(pat, mod_name, mod) for pat in ignore):
                continue
            out.append(Uncovered(f"{mod_name}.{leaf}", p.numel(), type(mod).__name__))
    return out


def matrix_params(model: nn.Module) -> int:
    seen = {}
    for p in model.parameters():
        if p.dim() >= 2:
            seen[id(p)] = p.numel()
    return sum(seen.values())


def check_coverage(model: nn.Module, planned: set[str], ignore: list[str]) -> list[Uncovered]:
    """The uncovered weights; a UserError when they hold more than MAX_UNCOVERED_SHARE of the matrix weights."""
    found = uncovered_weights(model, planned, ignore)
    total = matrix_params(model) or 1
    share = sum(u.numel for u in found) / total
    if share > MAX_UNCOVERED_SHARE:
        big = max(found, key=lambda u: u.numel)
        module = big.name.rpartition(".")[0]
        raise UserError(f"{share:.0%} of the weights would stay in float: {len(found)} tensors quantkit cannot "
                        f"quantise, e.g. {big.name} ({big.module_type}, {big.numel:,} values); quantkit refuses "
                        f"to write a checkpoint that claims fewer bits than it holds. Pass --ignore '{module}' "
                        "(or a pattern covering them) to keep them in float on purpose")
    return found
