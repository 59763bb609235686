"""`quantkit draft train`: an EAGLE-style draft head for a model, for `generate/serve --draft HEAD`."""
from __future__ import annotations

from typing import Optional

import typer

from .common import app, console, emit_json

# measured for SmolLM2 (49,152 tokens) on local text: docs/drafts.md, "Choosing N"
DEFAULT_VOCAB = 4096
# train's options -> the fields of a recipe's `draft:` section they match (tests/test_draft_eagle.py checks that
# every field but `train` is here, with the same default)
DRAFT_FLAGS = {"output": "output", "data": "data", "samples": "samples", "seq_len": "seq_len", "steps": "steps",
               "batch_size": "batch_size", "lr": "lr", "eval_every": "eval_every", "patience": "patience",
               "draft_vocab": "vocab", "seed": "seed"}

draft_app = typer.Typer(help="Draft heads for speculative decoding.\n\nExample: quantkit draft train embedded -o ./smollm2-head",
                        no_args_is_help=True)
app.add_typer(draft_app, name="draft")


@draft_app.command("train")
def train_cmd(
    path: str = typer.Argument(..., help="the target: quantkit checkpoint, Hugging Face model folder or 'embedded'"),
    output: str = typer.Option(..., "-o", "--output", help="folder for the head (model.safetensors, config.json) and its training state"),
    data: str = typer.Option("self", "--data", help="'self' (text the target samples itself), a dataset name, or a local .txt/.jsonl/.parquet file or folder"),
    samples: int = typer.Option(256, "--samples", help="token sequences to train and hold out on"),
    seq_len: int = typer.Option(128, "--seq-len", help="tokens per sequence"),
    steps: int = typer.Option(300, "--steps", help="most optimiser steps"),
    batch_size: int = typer.Option(8, "--batch-size", help="sequences per step (and per target forward)"),
    lr: float = typer.Option(1e-3, "--lr", help="AdamW learning rate"),
    eval_every: int = typer.Option(25, "--eval-every", help="steps between held-out evaluations (and saved states)"),
    patience: int = typer.Option(3, "--patience", help="evaluations without improvement before stopping early"),
    draft_vocab: int = typer.Option(DEFAULT_VOCAB, "--draft-vocab", help="draft only among the N tokens the training text and the target's own choices on it use most (the output-head product per drafted token shrinks by V/N; exact either way); 0: the whole vocabulary"),
    seed: int = typer.Option(0, "--seed", help="seed for the data order, the split and the head's initial weights"),
    resume: bool = typer.Option(True, "--resume/--restart", help="continue from OUTPUT's saved training state if there is one"),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="dtype the target runs in: float32 (CPU default), float16, bfloat16"),
    threads: Optional[int] = typer.Option(None, "--threads", help="CPU threads for torch"),
    device: str = typer.Option("auto", "--device", help="auto (a CUDA GPU when torch sees one), cpu or cuda"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar"),
    as_json: bool = typer.Option(False, "--json", help="print the training summary as JSON"),
) -> None:
    """Train an EAGLE-style draft head (one decoder layer over the target's features, sharing its embedding and
    output head) teacher-forced from the target's own forward passes.

    Example: quantkit draft train ./smollm2-w4 -o ./smollm2-w4-head --steps 300 && quantkit generate ./smollm2-w4 --draft ./smollm2-w4-head -p "Once upon a time"
    """
    from ..drafts.eagle_train import TrainOptions
    from ..drafts.train_job import train_draft_head
    from ..errors import UserError

    for name, value in (("--steps", steps), ("--batch-size", batch_size), ("--eval-every", eval_every),
                        ("--patience", patience)):
        if value < 1:
            raise UserError(f"{name} must be at least 1, got {value}")
    if draft_vocab < 0:
        raise UserError(f"--draft-vocab must be 0 (the whole vocabulary) or a token count, got {draft_vocab}")
    opts = TrainOptions(steps=steps, batch_size=batch_size, lr=lr, seed=seed, eval_every=eval_every,
                        patience=patience, resume=resume, vocab=draft_vocab)
    kwargs = dict(data=data, samples=samples, seq_len=seq_len, opts=opts, dtype=dtype, threads=threads, device=device)
    if quiet or as_json:
        result = train_draft_head(path, output, **kwargs)
    else:
        result = _with_bar(path, output, kwargs)
    if as_json:
        emit_json(result)
        return
    last = result["history"][-1]
    console.print(f"head saved to {output}: {result['steps']} steps, held-out loss {result['best_loss']:.4f}, "
                  f"top-1 agreement {last['heldout_top1']:.1%}, drafting over {result['draft_vocab']} tokens" + (" (stopped early)" if result["stopped_early"] else ""))


def _with_bar(path: str, output: str, kwargs: dict) -> dict:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..drafts.train_job import train_draft_head

    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("{task.fields[note]}"), console=console)
    held = {"text": ""}

    def report(step, total, info):
        if "heldout_loss" in info:
            held["text"] = f"held-out loss {info['heldout_loss']:.3f} top-1 {info['heldout_top1']:.1%}"
        bar.update(task, completed=step, total=total,
                   note=f"loss {info['loss']:.3f} top-1 {info['agree']:.1%}  {held['text']}")

    with bar:
        task = bar.add_task("training draft head", total=kwargs["opts"].steps, note="reading text, target features")
        return train_draft_head(path, output, progress=report, **kwargs)
