"""`quantkit run RECIPE`: quantise, then evaluate against the base if the recipe has `eval`, then check gates.

Everything the run needs is checked before the (long) quantisation starts, so a CI job with a broken
evaluation setup fails in seconds rather than after the model is quantised.
"""
from __future__ import annotations

from pathlib import Path

from .errors import UserError
from .recipe import Recipe


def eval_api():
    """(run_eval, check_gates) from quantkit.evaluate, or a UserError when that part is not installed."""
    try:
        from .evaluate import run_eval
        from .evaluate.gates import check_gates
    except ImportError as e:
        raise UserError(f"this recipe has an 'eval' section but quantkit's evaluation is not available ({e}); "
                        "remove 'eval:' from the recipe or pass --skip-eval") from None
    return run_eval, check_gates


def eval_output(recipe: Recipe) -> Path:
    if recipe.eval is not None and recipe.eval.output:
        return Path(recipe.eval.output).expanduser()
    return Path(f"{Path(recipe.output).expanduser()}-eval")


def _check_inputs(recipe: Recipe) -> None:
    e = recipe.eval
    for what, spec in (("eval.data", e.data), ("eval.tasks", e.tasks)):
        # a path-looking spec that does not exist is a typo; named datasets ('wikitext2') have no separator
        if spec and ("/" in spec or Path(spec).suffix) and not Path(spec).expanduser().exists():
            raise UserError(f"{what}: '{spec}' does not exist; fix the path in the recipe (relative paths are "
                            "from the working directory; '{recipe_dir}/...' is from the recipe's folder)")


def run_recipe(recipe: Recipe, progress=None, skip_eval: bool = False) -> dict:
    """The whole job; returns {'quantize': summary, 'eval': {...} or None, 'gates': {...} or None}."""
    from .job import quantize_to_checkpoint

    if not recipe.output:
        raise UserError("the recipe has no 'output'; add one or pass -o OUT")
    do_eval = recipe.eval is not None and not skip_eval
    if do_eval:
        run_eval, check_gates = eval_api()
        _check_inputs(recipe)
    draft = recipe.draft if recipe.draft is not None and recipe.draft.train else None
    if draft is not None:
        from .drafts.train_job import check_recipe_draft

        check_recipe_draft(draft)
    summary = quantize_to_checkpoint(recipe, progress=progress)
    result = {"quantize": summary, "eval": None, "gates": None, "draft": None}
    if do_eval:
        _evaluate(recipe, summary, result, run_eval, check_gates)
    # after eval, and not for a checkpoint that failed a gate: that run exits 1 and the head would be wasted
    if draft is not None and (result["gates"] is None or result["gates"]["passed"]):
        from .drafts.train_job import train_recipe_head

        result["draft"] = train_recipe_head(draft, summary["output"], device=recipe.device)
    return result


def _evaluate(recipe: Recipe, summary: dict, result: dict, run_eval, check_gates) -> None:
    from .models.hf import resolve_model_dir

    e = recipe.eval
    report_dir = eval_output(recipe)
    report = run_eval(str(resolve_model_dir(recipe.model)), [summary["output"]], data=e.data, tasks=e.tasks,
                      out_dir=str(report_dir), seq_len=e.seq_len, max_windows=e.max_windows,
                      max_new_tokens=e.max_new_tokens, device=recipe.device, gates=dict(e.gates), dtype=e.dtype,
                      stride=e.stride, text_field=e.text_field)
    failures = list(check_gates(report, e.gates)) if e.gates else []
    result["eval"] = {"report_dir": str(report_dir), "report": report}
    result["gates"] = {"thresholds": dict(e.gates), "failures": failures, "passed": not failures}
