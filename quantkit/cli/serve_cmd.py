"""`quantkit serve`: the OpenAI-compatible HTTP server over the runtime."""
from __future__ import annotations

from typing import Optional

import typer

from . import app
from .common import console, emit_json


@app.command("serve")
def serve_cmd(
    path: str = typer.Argument(..., help="quantkit checkpoint or Hugging Face model folder ('embedded' for SmolLM2-135M)"),
    host: str = typer.Option("127.0.0.1", "--host", help="address to bind (default: this machine only)"),
    port: int = typer.Option(8000, "--port", help="TCP port"),
    model_name: Optional[str] = typer.Option(None, "--model-name", help="name clients send as 'model' (default: the folder name)"),
    draft: Optional[str] = typer.Option(None, "--draft", help="draft model folder, or 'self-w4'"),
    prompt_lookup: Optional[int] = typer.Option(None, "--prompt-lookup", help="draft by prompt lookup: match the last N down to 2 tokens (N=1: single tokens)"),
    num_speculative_tokens: int = typer.Option(4, "--num-speculative-tokens", help="tokens drafted per verify step"),
    spec_max_batch: Optional[int] = typer.Option(None, "--spec-max-batch", help="speculate only while at most this many requests are active (default: 8 for float32 models, 3 for float16 checkpoints, 2 for int4/int8 checkpoints on a CPU, where it was measured to stop paying)"),
    max_batch: int = typer.Option(64, "--max-batch", help="requests decoded at the same time"),
    max_queue: int = typer.Option(256, "--max-queue", help="requests waiting beyond --max-batch before 429"),
    max_tokens_limit: Optional[int] = typer.Option(None, "--max-tokens-limit", help="largest max_tokens a request may ask (default: the context)"),
    kv_cache: str = typer.Option("auto", "--kv-cache", help="KV cache dtype: auto (model dtype) or fp8"),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="float32 (CPU default), float16, bfloat16"),
    compile_: bool = typer.Option(False, "--compile", help="torch.compile the decode step: faster per token after a slow first call (about a minute on a small CPU)"),
    threads: Optional[int] = typer.Option(None, "--threads", help="CPU threads for torch (default: torch's choice; 1 is fastest for small models on a busy machine)"),
    compare: Optional[str] = typer.Option(None, "--compare", help="base model to compare with side by side in the playground at / (same tokenizer)"),
    as_json: bool = typer.Option(False, "--json", help="print the resolved settings as JSON before serving"),
) -> None:
    """Serve a model over OpenAI-compatible HTTP (/v1/completions, /v1/chat/completions, /metrics).

    Example: quantkit serve ./smollm2-w4 --prompt-lookup 3 --port 8000
    then:    curl 127.0.0.1:8000/v1/completions -d '{"model": "smollm2-w4", "prompt": "Hello", "max_tokens": 16}'
    """
    from pathlib import Path

    import uvicorn

    from ..errors import UserError
    from ..runtime import build
    from ..runtime.engine import Engine
    from ..runtime.playground import load_compare, mount
    from ..runtime.server import create_app

    if kv_cache not in ("auto", "fp8"):
        raise UserError(f"unknown --kv-cache '{kv_cache}'; choose auto or fp8")
    for name, v in (("--max-batch", max_batch), ("--max-queue", max_queue), ("--num-speculative-tokens",
                                                                             num_speculative_tokens)):
        if v < 1:
            raise UserError(f"{name} must be at least 1, got {v}")
    build.set_threads(threads)
    dt = build.parse_dtype(dtype)
    model = build.load_model(path, dt)
    tok = build.load_tokenizer(path)
    make_drafter = build.drafter_factory(model, tok, draft=draft, prompt_lookup=prompt_lookup, dtype=dt)
    if compile_ and not build.compile_decode(model):  # after the drafter: a self-w4 draft copies the eager model
        typer.echo(build.STAYS_EAGER_NOTE, err=True)
    if kv_cache == "fp8":
        from ..runtime.kv_cache import new_cache

        new_cache(model, "fp8")  # fails now, with the reason, if the checkpoint has no calibrated KV scales
    name = model_name or Path(build.resolve_path(path)).name
    engine = Engine(model, tok, drafter_factory=make_drafter, num_speculative_tokens=num_speculative_tokens,
                    max_active=max_batch, max_queue=max_queue, spec_max_batch=spec_max_batch,
                    kv_cache=kv_cache)
    try:
        base = load_compare(compare, engine, dtype=dt, prompt_lookup=prompt_lookup, compile_=compile_,
                            max_active=max_batch, max_queue=max_queue, spec_max_batch=spec_max_batch) if compare else None
    except BaseException:
        engine.close()
        raise
    settings = {"model": name, "host": host, "port": port, "draft": draft, "prompt_lookup": prompt_lookup,
                "num_speculative_tokens": num_speculative_tokens, "max_batch": max_batch, "max_queue": max_queue,
                "compare": base.name if base else None, "compile": compile_}
    if as_json:
        emit_json(settings)
    else:
        console.print(f"serving '{name}' on http://{host}:{port}/v1, playground at http://{host}:{port}/ "
                      "(Ctrl-C to stop)")
    app = create_app(engine, name, max_tokens_limit=max_tokens_limit)
    mount(app, engine, name, compare=base, max_tokens_limit=max_tokens_limit)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:
        engine.close()
        if base:
            base.engine.close()
