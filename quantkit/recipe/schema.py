"""The recipe schema: everything a quantisation run needs, as data (YAML). The CLI builds one from its options.

Unknown keys are errors (extra="forbid") so a misspelt knob never silently does nothing. Each algorithm's own
options (GPTQOptions, AWQOptions, SignRoundOptions, SmoothQuantOptions) are defined beside its solver and
embedded here, so their defaults are written once. Field descriptions are the user documentation:
docs/recipes.md is generated from them (python -m quantkit.recipe.docs).
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ..capture.holdout import HOLDOUT
from ..solvers.awq_options import AWQOptions
from ..solvers.gptq_options import GPTQOptions
from ..solvers.options import StrictOptions, renamed
from ..solvers.signround_options import SignRoundOptions
from ..solvers.smoothquant_options import SmoothQuantOptions
from .gates import GATES
from .holdout_alias import one_holdout
from .memory_cap import parse_max_memory

Method = Literal["auto", "rtn", "gptq", "awq", "awq+gptq", "signround"]
SchemeName = Literal["w4a16", "w8a16", "w3a16", "w2a16", "fp8", "fp8-dynamic", "w8a8", "w8a8-static", "nvfp4", "mxfp4", "nvfp4-a4"]


def known_gates() -> dict[str, str]:
    """{gate name: meaning}; `quantkit eval --gate` reads the same table, so recipes and eval agree."""
    return dict(GATES)


# gate -> the eval input its metric needs (the same rule `quantkit eval` applies, checked here before quantising)
_GATE_NEEDS = {"max_ppl_increase": "data", "min_agreement": "tasks", "min_exact_match": "tasks"}


def _check_group_size(v):
    if v is not None and v != -1 and (v <= 0 or v & (v - 1)):
        raise ValueError("group_size must be a power of two (32, 64, 128) or -1 for per channel")
    return v


class _WithGroupSize(StrictOptions):
    """A section with a group_size field: checked the same way wherever it appears."""

    @field_validator("group_size", check_fields=False)
    @classmethod
    def _group(cls, v):
        return _check_group_size(v)


class TargetOverride(_WithGroupSize):
    """One per-module override: Linears matching `match` get this scheme instead of quant.scheme."""

    match: str = Field(..., description="Module name glob, 're:<regex>' or a module class name (e.g. 'Linear').")
    scheme: SchemeName = Field(..., description="Scheme for the Linears this entry matches.")
    group_size: int | None = Field(None, description="Group size for these Linears; default from the scheme.")
    symmetric: bool | None = Field(None, description="Symmetric grid for these Linears; default quant.symmetric.")



class MoEOptions(StrictOptions):
    """Mixture-of-experts models: how experts get calibration tokens (every expert is quantised regardless)."""

    calibrate_all_experts: bool = Field(
        False, description="Run every calibration token through every expert (the routed output is kept), so "
                           "no expert is solved from few tokens; costs experts/top-k times the expert compute.")
    min_tokens: int = Field(16, ge=0, description="An expert fed fewer calibration tokens than this is rounded "
                                                  "(RTN) instead of solved; reported in quantkit.json.")


class QuantOptions(_WithGroupSize):
    """What to quantise and how: the default scheme, the solver and its knobs, what stays in float."""

    scheme: SchemeName = Field("w4a16", description="Default scheme for every targeted Linear.")
    # 'auto' by default: the measured best per scheme and architecture (auto_method.py, docs/benchmarks.md)
    method: Method = Field("auto", description="Solver: auto, rtn, gptq, awq, awq+gptq or signround. 'auto': for "
                           "integer weights of 4 bits or fewer on an architecture AWQ has a map for, awq+gptq; "
                           "else rtn.")
    group_size: int | None = Field(
        None, description="32, 64, 128 or -1 (per channel); empty = the scheme's (128 for w4a16), or the "
                          "largest of 64, 32 dividing every targeted layer's width.")
    symmetric: bool = Field(True, description="Symmetric (no zero point) or asymmetric grid.")
    full_range: bool = Field(True, description="Symmetric 2-4 bit weights: each group's largest weight lands on "
                             "the grid's negative end (-8 at 4 bits; the scale carries its sign), steps of "
                             "absmax/8 instead of absmax/7. Same checkpoint format.")
    bits: float | None = Field(None, gt=2, le=8, description="Average bits per weight (scales included) to spend: "
                               "each Linear gets 3, 4 or 8 bits by its measured rounding sensitivity.")
    ignore: list[str] = Field(default_factory=lambda: ["lm_head"],
                              description="Module name globs or 're:<regex>' left in float.")
    targets: list[TargetOverride] = Field(default_factory=list,
                                          description="Per-module scheme overrides, first match wins.")
    clip_search: bool = Field(False, description="MSE search of the clipping range per group (RTN, GPTQ).")
    gptq: GPTQOptions = Field(default_factory=GPTQOptions, description="GPTQ knobs (method gptq or awq+gptq).")
    awq: AWQOptions = Field(default_factory=AWQOptions, description="AWQ knobs (method awq or awq+gptq).")
    signround: SignRoundOptions = Field(default_factory=SignRoundOptions,
                                        description="Learned-rounding knobs (method signround).")
    kv_cache: Literal["fp8"] | None = Field(None, description="Calibrate and store an FP8 KV cache scale.")
    moe: MoEOptions = Field(default_factory=MoEOptions, description="Mixture-of-experts calibration knobs.")
    smooth: bool = Field(False, description="SmoothQuant before a w8a8 scheme: per-channel scales moving "
                                            "activation outliers into the weights, folded into the previous op.")
    smoothquant: SmoothQuantOptions = Field(default_factory=SmoothQuantOptions,
                                            description="SmoothQuant knobs (when quant.smooth is on).")

    @model_validator(mode="before")
    @classmethod
    def _old_smooth_alpha(cls, data):
        return renamed(data, "smooth_alpha", "smoothquant.alpha", "quant")  # into SmoothQuant's own section



class CalibrationOptions(StrictOptions):
    """The text the solvers see: used by gptq, awq, static fp8 and the fp8 KV cache; ignored by rtn."""

    spec: str = Field("self", description="Dataset name from calibration/, a local file or folder, or 'self'.")
    num_samples: int = Field(128, ge=1, description="Calibration samples (sequences).")
    seq_len: int = Field(512, ge=8, description="Tokens per calibration sample.")
    seed: int = Field(0, description="Seed for sampling documents and self-generated text.")
    cut: Literal["chunk", "document"] = Field(
        "chunk", description="'chunk': concatenate and cut; 'document': one sample per document.")
    text_field: str = Field("text", description="Text field of JSON/CSV/parquet data.")
    min_tokens: int = Field(32, ge=1, description="Shortest document kept in 'document' mode.")
    holdout: float = Field(HOLDOUT, ge=0, lt=1, description=(
        "Share of the calibration samples (whole samples, the last ones) kept out of every fit to judge it: GPTQ "
        "keeps whichever of itself, itself without act-order and RTN does best on them; AWQ drops a scale or clip "
        "that loses to RTN there; learned rounding falls back to RTN on a layer that loses there (0: off). "
        f"{HOLDOUT}: the share GPTQ's guard was measured with (docs/benchmarks-history.md, \"Across domains\"); "
        "formerly quant.gptq/awq/signround.holdout."))


class EvalOptions(StrictOptions):
    """Evaluation of the checkpoint against the float model, run by `quantkit run` after quantising."""

    data: str | None = Field(None, description="Perplexity text set spec (dataset name, local file or folder).")
    tasks: str | None = Field(None, description="JSONL task set for greedy generation (exact match, agreement).")
    seq_len: int = Field(512, ge=8, description="Tokens per perplexity window.")
    max_windows: int | None = Field(None, ge=1, description="Perplexity windows at most; default all.")
    max_new_tokens: int = Field(32, ge=1, description="Tokens generated per task.")
    stride: int | None = Field(None, ge=1, description="Text tokens between window starts; default = no overlap.")
    text_field: str = Field("text", description="Text field of JSON/CSV/parquet data.")
    dtype: Literal["float16", "bfloat16", "float32"] | None = Field(
        None, description="Dtype models are evaluated in; default float32 on CPU, the checkpoint's on GPU.")
    output: str | None = Field(None, description="Report folder; default '<output>-eval' beside the checkpoint.")
    gates: dict[str, float] = Field(
        default_factory=dict,
        description="Thresholds the quantised model must meet, or `quantkit run` exits 1 (see eval.gates).")

    @field_validator("gates")
    @classmethod
    def _gates(cls, v):
        names = known_gates()
        for k in v:
            if k not in names:
                # the 'key' in ctx lets the error reporter point at this key's own line
                raise PydanticCustomError("unknown_gate", "unknown gate '{key}'", {"key": k, "choices": list(names)})
        return v

    @model_validator(mode="after")
    def _something_to_measure(self):
        if self.data is None and self.tasks is None:
            raise ValueError("eval needs 'data' (perplexity text) or 'tasks' (a JSONL task set), or both")
        for gate, needs in _GATE_NEEDS.items():
            if gate in self.gates and getattr(self, needs) is None:
                raise ValueError(f"gate {gate} needs eval.{needs}; add it or drop the gate")
        return self


class DraftOptions(StrictOptions):
    """A speculative-decoding draft head trained for the written checkpoint, by `quantkit run` after quantising
    (and after eval). Every field is also a `quantkit draft train` option (docs/drafts.md)."""

    train: bool = Field(True, description="Train the head; false keeps the section but skips the step.")
    output: str | None = Field(None, description="Head folder; default '<output>-draft' beside the checkpoint.")
    data: str = Field("self", description="Training text: 'self' (the checkpoint samples its own text), a "
                                          "dataset name, or a local file or folder.")
    samples: int = Field(256, ge=2, description="Token sequences to train and hold out on (a seeded 10% held out).")
    seq_len: int = Field(128, ge=8, description="Tokens per sequence.")
    steps: int = Field(300, ge=1, description="Most optimiser steps.")
    batch_size: int = Field(8, ge=1, description="Sequences per step.")
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate.")
    eval_every: int = Field(25, ge=1, description="Steps between held-out evaluations (and saved states).")
    patience: int = Field(3, ge=1, description="Evaluations without improvement before stopping early.")
    vocab: int = Field(4096, ge=0, description="Draft only among the N most used tokens of the training text "
                                               "(the output product per drafted token shrinks by V/N; exact "
                                               "either way); 0 = the whole vocabulary.")
    seed: int = Field(0, description="Seed for the split, the data order and the head's initial weights.")


class Recipe(StrictOptions):
    """A whole quantisation run."""

    @model_validator(mode="before")
    @classmethod
    def _one_holdout(cls, data):
        return one_holdout(data)  # quant.<solver>.holdout, one share now (holdout_alias.py)

    description: str | None = Field(None, description="Free text saying what the recipe is for; not used.")
    model: str | None = Field(None, description="HF folder or hub id; empty = the embedded SmolLM2-135M.")
    output: str | None = Field(None, description="Checkpoint folder to write (relative to the working directory).")
    overwrite: bool = Field(False, description="Replace a non-empty output folder.")
    dtype: Literal["auto", "float16", "bfloat16", "float32"] = Field(
        "auto", description="Dtype the float model is loaded and solved in; 'auto' = the model's own.")
    device: str = Field("cpu", description="cpu or cuda (one decoder layer at a time on the device).")
    max_memory: str | None = Field(
        None, description="What quantkit may hold per device, as accelerate writes it: '2GiB' (every device) or "
                          "'cpu=2GiB,cuda:0=70GiB'; empty = what each device has free. When the float model does "
                          "not fit, self-calibration samples with a round-to-nearest W8 copy (W4 where W8 does not fit) built layer by layer.")
    quant: QuantOptions = Field(default_factory=QuantOptions, description="What to quantise and how.")
    calibration: CalibrationOptions = Field(default_factory=CalibrationOptions,
                                            description="Calibration data (gptq, awq, fp8 static, fp8 KV cache).")
    eval: EvalOptions | None = Field(None, description="Evaluation against the base model, run by `quantkit run`.")
    draft: DraftOptions | None = Field(None, description="A draft head for speculative decoding, trained for the "
                                                         "checkpoint by `quantkit run` after quantising.")

    @field_validator("max_memory")
    @classmethod
    def _max_memory(cls, v):
        if v is not None:
            parse_max_memory(v)  # refused here, one line, before anything is loaded
        return v
