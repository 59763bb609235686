"""The recipe: everything a quantisation run needs, as data (YAML). The CLI builds one from its flags.

Unknown keys are errors (extra="forbid") so a misspelt knob never silently does nothing.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

Method = Literal["rtn", "gptq", "awq", "awq+gptq"]
SchemeName = Literal["w4a16", "w8a16", "fp8", "fp8-dynamic"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class GPTQOptions(_Strict):
    damp: float = Field(0.01, gt=0, lt=1, description="Dampening as a fraction of the Hessian's mean diagonal.")
    block_size: int = Field(128, ge=1, description="Columns updated together (lazy batch updates).")
    actorder: Literal["off", "weight", "group"] = Field(
        "off", description="Quantise columns by decreasing Hessian diagonal; 'group' needs g_idx at run time.")
    static_groups: bool = Field(True, description="Fix group scales before reordering (no g_idx with 'weight').")


class AWQOptions(_Strict):
    grid: int = Field(20, ge=2, description="Points of the alpha grid in [0, 1].")
    duo: bool = Field(False, description="Use s = mean|x|^a / mean|w|^(1-a) instead of mean|x|^a.")
    clip: bool = Field(True, description="Per-group clip search after scaling.")
    fallback: Literal["error", "rtn"] = Field(
        "error", description="What to do with an architecture that has no AWQ map.")


class TargetOverride(_Strict):
    match: str = Field(..., description="Module name glob, 're:<regex>' or a module class name (e.g. 'Linear').")
    scheme: SchemeName
    group_size: int | None = None
    symmetric: bool | None = None


class QuantOptions(_Strict):
    scheme: SchemeName = Field("w4a16", description="Default scheme for every targeted Linear.")
    method: Method = Field("rtn", description="Solver: rtn, gptq, awq or awq+gptq.")
    group_size: int | None = Field(None, description="32, 64, 128 or -1 (per channel); default from the scheme.")
    symmetric: bool = Field(True, description="Symmetric (no zero point) or asymmetric grid.")
    ignore: list[str] = Field(default_factory=lambda: ["lm_head"],
                              description="Module name globs or 're:<regex>' left in float.")
    targets: list[TargetOverride] = Field(default_factory=list, description="Per-module scheme overrides, first match wins.")
    clip_search: bool = Field(False, description="MSE search of the clipping range per group (RTN, GPTQ).")
    gptq: GPTQOptions = Field(default_factory=GPTQOptions)
    awq: AWQOptions = Field(default_factory=AWQOptions)
    kv_cache: Literal["fp8"] | None = Field(None, description="Calibrate and store an FP8 KV cache scale.")

    @field_validator("group_size")
    @classmethod
    def _group(cls, v):
        if v is not None and v != -1 and (v <= 0 or v & (v - 1)):
            raise ValueError("group_size must be a power of two (32, 64, 128) or -1 for per channel")
        return v


class CalibrationOptions(_Strict):
    spec: str = Field("self", description="Dataset name from calibration/, a local file or folder, or 'self'.")
    num_samples: int = Field(128, ge=1)
    seq_len: int = Field(512, ge=8)
    seed: int = 0
    cut: Literal["chunk", "document"] = "chunk"
    text_field: str = "text"
    min_tokens: int = Field(32, ge=1, description="Shortest document kept in 'document' mode.")


class EvalOptions(_Strict):
    data: str | None = Field(None, description="Perplexity text set spec.")
    tasks: str | None = Field(None, description="JSONL task set.")
    seq_len: int = 512
    max_windows: int | None = None
    max_new_tokens: int = 32
    gates: dict[str, float] = Field(default_factory=dict)


class Recipe(_Strict):
    model: str | None = Field(None, description="HF folder or hub id; empty = the embedded SmolLM2-135M.")
    output: str | None = None
    overwrite: bool = False
    dtype: Literal["auto", "float16", "bfloat16", "float32"] = "auto"
    device: str = "cpu"
    quant: QuantOptions = Field(default_factory=QuantOptions)
    calibration: CalibrationOptions = Field(default_factory=CalibrationOptions)
    eval: EvalOptions | None = None


def load_recipe(path) -> Recipe:
    """Read and validate a recipe YAML file; every mistake is a UserError naming the file and the field."""
    from pathlib import Path

    import yaml
    from pydantic import ValidationError

    from .errors import UserError

    p = Path(path)
    if not p.is_file():
        raise UserError(f"recipe file '{p}' does not exist; see recipes/ for examples")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise UserError(f"{p}: not valid YAML ({str(e).splitlines()[0]})") from None
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        raise UserError(f"{p}: field '{where}': {err['msg']}") from None


def apply_overrides(recipe: Recipe, overrides: dict) -> Recipe:
    """Set dotted fields ('quant.group_size') from CLI flags; None means 'not given'."""
    from pydantic import ValidationError

    from .errors import UserError

    data = recipe.model_dump()
    for key, value in overrides.items():
        if value is None:
            continue
        node = data
        *parents, leaf = key.split(".")
        for k in parents:
            if node.get(k) is None:
                node[k] = {}
            node = node[k]
        node[leaf] = value
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        raise UserError(f"option {'.'.join(str(x) for x in err['loc'])}: {err['msg']}") from None
