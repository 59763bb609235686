"""`quantkit draft train`: open the target as the runtime serves it, gather text, train and save a head."""
from __future__ import annotations

import time
from pathlib import Path

import torch

from ..data.calibration import load_calibration
from ..errors import UserError
from ..runtime import build
from .eagle_train import TrainOptions, train_head


def train_draft_head(path: str, out: str, *, data: str = "self", samples: int = 256, seq_len: int = 128,
                     opts: TrainOptions | None = None, dtype: str | None = None, threads: int | None = None,
                     device: str | None = None, progress=None) -> dict:
    """Train an EAGLE head for the model at `path` (a quantkit checkpoint is loaded as the runtime serves it, so
    the head learns the quantised model's features) on `samples` sequences of `seq_len` tokens from `data`
    ('self': text the target samples itself; or a dataset name, file or folder the calibration loaders read)."""
    opts = opts or TrainOptions()
    if samples < 2 or seq_len < 8:
        raise UserError(f"--samples must be at least 2 and --seq-len at least 8 (got {samples}, {seq_len})")
    from ..devices import resolve_device
    from ..dtypes import parse_dtype
    from ..runtime.checkpoint import load

    build.set_threads(threads)
    tok = build.load_tokenizer(path)
    # the checkpoint's own modules, not the runtime's decode layout: that is tuned for a few rows per product,
    # and training runs whole sequences through the target
    device = resolve_device(device)
    model = load(path, device=device, dtype=parse_dtype(dtype) or torch.float32, exact=True)
    model.requires_grad_(False)
    inner = getattr(model, "model", None)
    if not (hasattr(inner, "rotary_emb") and hasattr(inner, "norm")):
        raise UserError(f"{type(model).__name__} is not a decoder with rotary positions (Llama, Mistral, "
                            "Qwen): an EAGLE head reads its final-norm features; use --draft early-exit:N instead")
    t = time.perf_counter()
    calib = load_calibration(data, tok, num_samples=samples, seq_len=seq_len, seed=opts.seed, model=model)
    data_s = time.perf_counter() - t
    if len({int(s.numel()) for s in calib.samples}) != 1:
        raise UserError(f"the text from {data!r} gave sequences of different lengths; use a chunked source")
    result = train_head(model, calib.samples, out, opts, progress)
    result.update(data=data, data_s=data_s, samples=len(calib.samples), seq_len=seq_len, output=str(out))
    return result


def recipe_head_dir(draft, checkpoint: str) -> Path:
    """Where a recipe's `draft:` step writes its head: draft.output, or '<checkpoint>-draft' beside it."""
    return Path(draft.output).expanduser() if draft.output else Path(f"{Path(checkpoint).expanduser()}-draft")


def check_recipe_draft(draft) -> None:
    """Before quantising: a path-looking `draft.data` that does not exist is a typo to report in seconds."""
    spec = draft.data
    if ("/" in spec or Path(spec).suffix) and not Path(spec).expanduser().exists():
        raise UserError(f"draft.data: '{spec}' does not exist; fix the path in the recipe (relative paths are "
                        "from the working directory; '{recipe_dir}/...' is from the recipe's folder)")


def train_recipe_head(draft, checkpoint: str, device: str | None = None, progress=None) -> dict:
    """A recipe's `draft:` step (recipe.schema.DraftOptions): the head for the checkpoint just written, with the
    same knobs `quantkit draft train` takes."""
    opts = TrainOptions(steps=draft.steps, batch_size=draft.batch_size, lr=draft.lr, seed=draft.seed,
                        eval_every=draft.eval_every, patience=draft.patience, vocab=draft.vocab)
    out = recipe_head_dir(draft, checkpoint)
    return train_draft_head(checkpoint, str(out), data=draft.data, samples=draft.samples, seq_len=draft.seq_len,
                            opts=opts, device=device, progress=progress)
