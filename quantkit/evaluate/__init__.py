"""`quantkit eval`: a baseline against its quantised variants on the same text and prompts.

Per variant and per task: perplexity, greedy exact match, agreement with the baseline, KL tails with the
worst positions, latency, memory; written as report.json, report.md and PNG plots. Import cost stays low:
the heavy modules load inside run_eval.
"""
from __future__ import annotations

from .gates import GATES, check_gates, parse_gates

__all__ = ["run_eval", "check_gates", "parse_gates", "GATES"]


def run_eval(base, variants, data=None, tasks=None, out_dir=None, seq_len=512, max_windows=None,
             max_new_tokens=32, device="cpu", *, gates=None, dtype=None, stride=None, text_field="text",
             scratch_dir=None, plots=True, log=None, backends=None, backend_options=None) -> dict:
    """Evaluate BASE and each VARIANT (folders, 'LABEL=folder', or 'embedded'); returns the report dict.

    `gates` ({name: bound}) adds report["gate_failures"]; `out_dir` writes report.json, report.md,
    answers.jsonl and the plots there. `backends` (two or more of quantkit, transformers, vllm, llama.cpp) adds
    report["backends"]: every model scored by each engine (backend_report.compare_backends' options).
    """
    from . import gates as G
    from ..errors import UserError
    from .models import load_tokenizer, parse_specs

    gates = dict(gates or {})
    _check_args(data, tasks, max_new_tokens)
    if backends:  # before the long part: a mistyped backend or a missing vLLM venv fails at once
        from .backend_report import check_backends
        from .backends import vllm_python

        backends = check_backends(list(backends))
        if "vllm" in backends:
            vllm_python((backend_options or {}).get("vllm_python_path"))
    G.validate_inputs(gates, bool(data), bool(tasks))
    if not variants and not backends:
        raise UserError("give at least one VARIANT to compare with BASE (e.g. quantkit eval ./model ./model-w4), "
                        "or --backend twice to score BASE alone with two engines")
    specs = parse_specs(str(base), [str(v) for v in (variants or [])])
    if backends and "llama.cpp" in backends:  # a folder, or no scorer built, fails before the long part too
        from .llama_cpp_backend import check_models, scorer_path

        check_models(specs)
        scorer_path()
    tok = load_tokenizer(specs)
    inputs = _inputs(tok, data, tasks, seq_len, stride, max_windows, text_field)
    settings = {"data": str(data) if data else None, "tasks": str(tasks) if tasks else None, "seq_len": seq_len,
                "windows": len(inputs["windows"]), "stride": inputs["stride"], "num_tasks": len(inputs["tasks"]),
                "max_new_tokens": max_new_tokens, "device": str(device), "dtype": str(dtype)}
    if inputs["windows"]:
        settings["data_sha256"] = inputs["windows"].meta.get("sha256")
    rows, kls, items = _evaluate_all(specs, tok, inputs, max_new_tokens, device, dtype, scratch_dir,
                                     log or (lambda msg: None))
    report = {"base": specs[0].label, "settings": settings, "variants": rows}
    if backends:
        report["backends"] = _backends(specs, inputs, backends, dict(backend_options or {}), dtype, log)
    if gates:
        report["gates"] = gates
        report["gate_failures"] = G.check_gates(report, gates)
    if out_dir is not None:
        _write(report, kls, items, out_dir, plots)
    return report


def _backends(specs, inputs: dict, backends, options: dict, dtype, log) -> dict:
    """The backend section scores at most `windows` windows (8) and the task prompts, or the start of the
    first two windows when there are no tasks, in --dtype; by default float16 when vLLM is among the backends
    (its CPU W4 kernels have no float32), else float32 (llama.cpp computes in float32 from its blocks)."""
    from .backend_report import compare_backends

    windows = inputs["windows"][:options.pop("windows", 8)]
    prompts = [list(p) for p in inputs["prompts"]][:8] or [w[:32].tolist() for w in windows[:2]]
    dtype = dtype or ("float16" if "vllm" in backends else "float32")
    return compare_backends(specs, windows, prompts, backends, dtype=dtype,
                            log=log or (lambda msg: None), **options)


def _check_args(data, tasks, max_new_tokens) -> None:
    from ..errors import UserError

    if not data and not tasks:
        raise UserError("nothing to evaluate; pass --data SPEC (perplexity text) and/or --tasks FILE.jsonl "
                        "(e.g. calibration/tasks/eval_tasks.jsonl)")
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")


def _inputs(tok, data, tasks, seq_len, stride, max_windows, text_field) -> dict:
    """What every model is scored on: perplexity windows (and their scored body length) and task prompts."""
    from ..data import load_eval_windows, load_tasks
    from ..data.tokens import prefix_special_ids

    task_list = load_tasks(tasks) if tasks else []
    windows, body, stride_used = [], 0, 0
    if data:
        windows = load_eval_windows(str(data), tok, seq_len=seq_len, stride=stride, max_windows=max_windows,
                                    text_field=text_field)
        body = seq_len - len(prefix_special_ids(tok))
        stride_used = windows.meta["stride"]
    return {"tasks": task_list, "windows": windows, "body": body, "stride": stride_used,
            "prompts": [tok(t.prompt)["input_ids"] for t in task_list]}


def _evaluate_all(specs, tok, inputs: dict, max_new_tokens, device, dtype, scratch_dir, log):
    """(report rows, per-variant KL arrays, per-task outputs of every model): the base first, then each variant
    against the base's log-probs and answers."""
    from .runner import _dtype_for, evaluate_model
    from .store import LogProbStore

    rows, kls, items, base_answers = [], {}, {}, {}
    store = LogProbStore(scratch_dir)
    try:
        for i, spec in enumerate(specs):
            res = evaluate_model(spec, is_base=i == 0, tok=tok, windows=inputs["windows"], body=inputs["body"],
                                 stride=inputs["stride"], tasks=inputs["tasks"], prompts=inputs["prompts"],
                                 max_new=max_new_tokens, device=device, dtype=_dtype_for(device, dtype),
                                 store=store, base_answers=base_answers, log=log)
            if i == 0:
                base_answers = res["answers"]
            rows.append(res["row"])
            if i:
                kls[spec.label] = res["kl"]
            for it in res["items"]:
                rec = items.setdefault(it["id"], {"id": it["id"], "task": it["task"], "outputs": {}})
                rec["outputs"][spec.label] = it["output"]
    finally:
        store.close()
    for t in inputs["tasks"]:
        if t.id in items:
            items[t.id]["prompt"], items[t.id]["answer"] = t.prompt, t.answer
    return rows, kls, items


def _write(report: dict, kls: dict, items: dict, out_dir, plots: bool) -> None:
    import json
    from pathlib import Path

    from .plot import make_plots
    from .report import write_reports

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    made = make_plots(report, kls, out) if plots else []
    report["files"] = write_reports(report, items, out, made)
    # report.json is written before "files" is known; rewrite so it lists them too.
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
