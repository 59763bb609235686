"""What the quantise job can refuse before it reads a weight: a --seq-len beyond the model's context and
calibration text that cannot give the requested samples. Both need only config.json, the recipe and the
tokenizer, so a user hears about them in seconds rather than after a 140 GB model has been read."""
from __future__ import annotations

from .errors import UserError

# where transformers' configs keep the longest sequence the position encoding was trained for
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def context_length(config) -> tuple[int, str] | None:
    """(tokens, the config key that says so), or None when the config names no limit."""
    for key in CONTEXT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value, getattr(config, "attribute_map", {}).get(key, key)  # as config.json spells it
    return None


def check_seq_len(seq_len: int, config, src) -> None:
    """Calibration windows longer than the context would run positions the model never saw (or index past its
    position table), so the calibration statistics would describe inputs it never gets."""
    limit = context_length(config)
    if limit is not None and seq_len > limit[0]:
        raise UserError(f"--seq-len {seq_len} is longer than the context of '{src}' ({limit[0]} tokens, "
                        f"config.json {limit[1]}); pass --seq-len {limit[0]} or less")


def calibration(recipe, tokenizer, model=None, **self_options):
    """The recipe's calibration set (model: what samples text for spec "self", with self_options such as
    batch_size)."""
    from .data import load_calibration

    c = recipe.calibration
    return load_calibration(spec=c.spec, tokenizer=tokenizer, num_samples=c.num_samples, seq_len=c.seq_len,
                            seed=c.seed, cut=c.cut, text_field=c.text_field, min_tokens=c.min_tokens, model=model,
                            **self_options)


def check(recipe, config, src, tokenizer):
    """The checks of a run that needs calibration data, before any weight is read. Returns (samples, meta) when
    the text comes from a file, folder or dataset (tokenised and cut now, so too little of it is the loader's
    one-line error here); None for text the model samples itself, which needs its weights."""
    from .data.resolve import SELF

    if tokenizer is None:
        raise UserError(f"'{src}' has no tokenizer; method {recipe.quant.method} calibrates on text and needs one "
                        "(save the tokenizer beside the model, or pass --method rtn)")
    check_seq_len(recipe.calibration.seq_len, config, src)
    if (recipe.calibration.spec or SELF) == SELF:
        return None
    cs = calibration(recipe, tokenizer)
    return cs.samples, cs.meta
