"""`quantkit eval`: a baseline against quantised variants; exit 1 when a --gate fails."""
from __future__ import annotations

from typing import Optional

import typer

from .common import app, console, emit_json


@app.command("eval")
def eval_(
    base: str = typer.Argument(..., help="Baseline model folder ('LABEL=PATH' to name it; 'embedded' for SmolLM2-135M)."),
    variants: Optional[list[str]] = typer.Argument(None, help="Variant checkpoint folders, each PATH or LABEL=PATH (none: BASE alone, with --backend)."),
    data: Optional[str] = typer.Option(None, "--data", help="Perplexity text: dataset name, .txt/.jsonl/.parquet file or saved dataset folder."),
    tasks: Optional[str] = typer.Option(None, "--tasks", help="Task set JSONL (id, task, prompt, answer), e.g. calibration/tasks/eval_tasks.jsonl."),
    output: Optional[str] = typer.Option(None, "-o", "--output", help="Folder for report.json, report.md, answers.jsonl and the plots."),
    gate: Optional[list[str]] = typer.Option(None, "--gate", help="NAME=VALUE threshold, repeatable: max_ppl_increase, min_agreement, min_token_agreement, max_kl_mean, max_kl_p99, min_exact_match."),
    seq_len: int = typer.Option(512, "--seq-len", help="Tokens per perplexity window."),
    max_windows: Optional[int] = typer.Option(None, "--max-windows", help="Use at most this many windows."),
    stride: Optional[int] = typer.Option(None, "--stride", help="Window stride in text tokens (default: no overlap)."),
    text_field: str = typer.Option("text", "--text-field", help="Text field of JSON/CSV/parquet data."),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", help="Greedy tokens per task prompt (answers stop at a line end)."),
    device: str = typer.Option("auto", "--device", help="auto (CUDA when this torch sees a GPU, else CPU), cpu, cuda or cuda:N."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="float16, bfloat16 or float32 (default: float32 on CPU, the checkpoint's on GPU)."),
    backend: Optional[list[str]] = typer.Option(None, "--backend", help="Also score every model with these engines side by side (repeatable, two or more): quantkit, transformers, vllm, llama.cpp (GGUF files only, through llama.cpp's own kernels; bash bench/llama_cpp_build.sh builds its scorer)."),
    vllm_python: Optional[str] = typer.Option(None, "--vllm-python", help="Python of vLLM's own venv (bash bench/vllm_env.sh makes one; or QUANTKIT_VLLM_PYTHON)."),
    backend_tolerance: float = typer.Option(0.005, "--backend-tolerance", help="Flag a backend whose perplexity departs from the backends' median by more than this (0.005 = 0.5%)."),
    backend_windows: int = typer.Option(8, "--backend-windows", help="Windows the backend comparison scores."),
    no_plots: bool = typer.Option(False, "--no-plots", help="Skip the PNG plots."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress lines."),
    as_json: bool = typer.Option(False, "--json", help="Print report.json on stdout instead of the tables."),
):
    """Compare BASE with each VARIANT on the same text and prompts: perplexity, exact match, agreement, KL tails,
    latency and memory, overall and per task.

    Example: quantkit eval ./model w4=./model-w4 --data wikitext2 --tasks calibration/tasks/eval_tasks.jsonl -o report --gate max_kl_p99=0.5

    Engines side by side: quantkit eval ./model w4=./model-w4 --data wikitext2 --dtype float16 --backend quantkit --backend transformers --backend vllm --vllm-python .venv-vllm/bin/python

    One GGUF file through llama.cpp's kernels and quantkit's decode: quantkit eval model-q4_k_m.gguf --data wikitext2 --backend quantkit --backend llama.cpp
    """
    from ..errors import UserError
    from ..evaluate import parse_gates, run_eval
    from ..devices import resolve_device

    gates = parse_gates(gate)
    device = resolve_device(device)
    if dtype is not None and dtype not in ("float16", "bfloat16", "float32"):
        raise UserError(f"--dtype must be float16, bfloat16 or float32, got '{dtype}'")
    log = (lambda msg: None) if quiet or as_json else (lambda msg: console.print(f"[dim]{msg}[/]"))
    report = run_eval(base, variants, data=data, tasks=tasks, out_dir=output, seq_len=seq_len,
                      max_windows=max_windows, max_new_tokens=max_new_tokens, device=device, gates=gates,
                      dtype=dtype, stride=stride, text_field=text_field, plots=not no_plots, log=log,
                      backends=backend, backend_options={"tolerance": backend_tolerance, "windows": backend_windows,
                                                         "vllm_python_path": vllm_python})
    if as_json:
        emit_json(report)
    else:
        from ..evaluate.report import print_tables

        print_tables(report, console)
        if output:
            console.print(f"[green]wrote[/] {output}/report.md, report.json")
    if report.get("gate_failures"):
        raise typer.Exit(1)
