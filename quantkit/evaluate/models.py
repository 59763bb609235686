"""What eval compares: labelled model folders, loaded one at a time with the runtime's loader."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError


@dataclass(frozen=True)
class ModelSpec:
    label: str
    path: Path  # a model folder; for a GGUF file, the float folder of its dequantised weights
    gguf: Path | None = None  # the GGUF file PATH was made from

    @property
    def quantized(self) -> bool:
        from .memory import config_of

        if self.gguf is not None:
            from ..inspect_gguf import gguf_types

            return any(t not in ("F32", "F16", "BF16") for t in gguf_types(self.gguf))
        return "quantization_config" in config_of(self.path)


def parse_spec(spec: str) -> ModelSpec:
    """'LABEL=PATH' or 'PATH' (labelled by its folder or file name); 'embedded' is the bundled SmolLM2-135M. PATH
    may be a .gguf file: it is scored as the float model of its weights as llama.cpp dequantises them."""
    from ..models.gguf_float import is_gguf
    from ..models.hf import resolve_model_dir

    label, sep, where = spec.partition("=")
    if not sep or not label or "/" in label:
        label, where = "", spec
    path = resolve_model_dir(None if where in ("embedded", "") else where)
    gguf = Path(where).expanduser() if is_gguf(Path(where).expanduser()) else None
    return ModelSpec(label or (Path(where).name if where != "embedded" else "embedded"), path, gguf)


def parse_specs(base: str, variants: list[str]) -> list[ModelSpec]:
    specs = [parse_spec(str(s)) for s in [base, *variants]]
    labels = [s.label for s in specs]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise UserError(f"two models are labelled {', '.join(dup)}; name them as LABEL=PATH")
    return specs


def load_tokenizer(specs: list[ModelSpec]):
    from transformers import AutoTokenizer

    for s in specs:
        try:
            return AutoTokenizer.from_pretrained(s.path)
        except (OSError, ValueError, TypeError):
            continue
    raise UserError(f"no tokenizer found beside {specs[0].path}; save the tokenizer in the BASE folder")
