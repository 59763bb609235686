"""What eval compares: labelled model folders, loaded one at a time with the runtime's loader."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError


@dataclass(frozen=True)
class ModelSpec:
    label: str
    path: Path

    @property
    def quantized(self) -> bool:
        from .memory import config_of

        return "quantization_config" in config_of(self.path)


def parse_spec(spec: str) -> ModelSpec:
    """'LABEL=PATH' or 'PATH' (labelled by its folder name); 'embedded' is the bundled SmolLM2-135M."""
    from ..models.hf import resolve_model_dir

    label, sep, where = spec.partition("=")
    if not sep or not label or "/" in label:
        label, where = "", spec
    path = resolve_model_dir(None if where in ("embedded", "") else where)
    return ModelSpec(label or (Path(where).name if where != "embedded" else "embedded"), path)


def parse_specs(base: str, variants: list[str]) -> list[ModelSpec]:
    if not variants:
        raise UserError("give at least one VARIANT to compare with BASE, e.g. quantkit eval ./model ./model-w4")
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
