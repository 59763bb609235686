"""`quantkit generate`: one prompt through the runtime's decode loop, printing the completion and metrics."""
from __future__ import annotations

from typing import Optional

import typer

from .common import app, console, emit_json


@app.command("generate")
def generate_cmd(
    path: str = typer.Argument(..., help="quantkit checkpoint or Hugging Face model folder ('embedded' for SmolLM2-135M)"),
    prompt: str = typer.Option(..., "--prompt", "-p", help="text to continue (or the user message with --chat)"),
    chat: bool = typer.Option(False, "--chat", help="wrap the prompt in the model's chat template"),
    max_tokens: int = typer.Option(64, "--max-tokens", help="most tokens to generate"),
    temperature: float = typer.Option(0.0, "--temperature", help="0 is greedy"),
    top_k: int = typer.Option(0, "--top-k", help="keep the k most likely tokens (0: off)"),
    top_p: float = typer.Option(1.0, "--top-p", help="nucleus sampling mass (1: off)"),
    seed: Optional[int] = typer.Option(None, "--seed", help="sampling seed"),
    stop: list[str] = typer.Option([], "--stop", help="stop string (repeatable)"),
    draft: Optional[str] = typer.Option(None, "--draft", help="draft model folder, a head folder from 'quantkit draft train', 'early-exit:N' (the target's first N layers), or 'self-w4' (the target's own W4 RTN quantisation)"),
    prompt_lookup: Optional[int] = typer.Option(None, "--prompt-lookup", help="draft by prompt lookup: match the last N down to 2 tokens (N=1: single tokens)"),
    num_speculative_tokens: int = typer.Option(4, "--num-speculative-tokens", help="tokens drafted per verify step"),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="float32 (CPU default), float16, bfloat16"),
    device: str = typer.Option("auto", "--device", help="auto (CUDA when this torch sees a GPU, else CPU), cpu, cuda or cuda:N"),
    compile_: bool = typer.Option(False, "--compile", help="torch.compile the decode step: faster per token after a slow first call (about a minute on a small CPU)"),
    threads: Optional[int] = typer.Option(None, "--threads", help="CPU threads for torch (default: torch's choice; 1 is fastest for small models on a busy machine)"),
    as_json: bool = typer.Option(False, "--json", help="print completion, tokens and metrics as JSON"),
    explain: bool = typer.Option(False, "--explain", help="print which kernel path each Linear kind runs and why (the times measured at load), on stderr (in --json: 'kernel_paths')"),
) -> None:
    """Generate a completion and print it with the decode metrics.

    Example: quantkit generate ./smollm2-w4 --prompt "def add(a, b):" --prompt-lookup 3 --max-tokens 64 --json
    """
    import torch

    from ..open_model import open_model
    from ..devices import resolve_device
    from ..runtime.generate import generate
    from ..runtime.sampling import SamplingParams

    if num_speculative_tokens < 1:
        from ..errors import UserError

        raise UserError(f"--num-speculative-tokens must be at least 1, got {num_speculative_tokens}")
    device = resolve_device(device)  # before any loading: a missing GPU is a one-line error
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                            stop=list(stop)).validate()
    opened = open_model(path, dtype=dtype, threads=threads, draft=draft, prompt_lookup=prompt_lookup,
                        compile=compile_, warn=lambda note: typer.echo(note, err=True), device=device)
    model, tok, make_drafter = opened.model, opened.tokenizer, opened.make_drafter
    paths = explained_paths(model) if explain else None
    if paths and not as_json:
        typer.echo("\n".join(paths), err=True)
    if chat:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    else:
        ids = tok(prompt)["input_ids"]
    with torch.inference_mode():
        seq = generate(model, ids, params, drafter=make_drafter() if make_drafter else None,
                       num_speculative_tokens=num_speculative_tokens, tokenizer=tok)
    metrics = seq.metrics.to_dict()
    if as_json:
        extra = {} if paths is None else {"kernel_paths": paths}
        emit_json({**extra, "completion": seq.text(), "finish_reason": seq.finish_reason, "metrics": metrics,
                   "tokens": [{"id": t.id, "text": t.text, "logprob": t.logprob, "drafted": t.drafted}
                              for t in seq.tokens]})
        return
    typer.echo(seq.text())
    shown = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in metrics.items() if v is not None}
    console.print("  ".join(f"{k}={v}" for k, v in shown.items()), style="dim")


def explained_paths(model) -> list[str]:
    """kernel_paths' lines, or one saying why there are none (a GPU model picks its kernels per call)."""
    from ..linear.dispatch import kernel_paths

    return kernel_paths(model) or ["kernel paths: no CPU choices for this model (on a GPU, or loaded exact): "
                                   "kernels/dispatch.py picks each call's kernel by device and rows"]
