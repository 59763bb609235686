"""`quantkit recipe validate|show|list` and `quantkit run RECIPE`."""
from __future__ import annotations

from typing import Optional

import typer

from .common import app, console, emit_json
from .set_option import SET_HELP, fields_help, parse_set

recipe_app = typer.Typer(name="recipe", no_args_is_help=True,
                         help="Check, print and list recipes (YAML files describing a quantisation run).")
app.add_typer(recipe_app, name="recipe")


@recipe_app.command("validate")
def validate(
    files: list[str] = typer.Argument(..., help="Recipe YAML files (or preset names) to check."),
):
    """Check recipe files without running them; every mistake is listed as FILE:LINE: FIELD: what was expected.

    Example: quantkit recipe validate recipes/*.yaml
    """
    from ..errors import UserError
    from ..recipe import load_recipe, resolve_recipe_path
    from ..recipe.errors import RecipeError

    bad = 0
    for f in files:
        try:
            load_recipe(resolve_recipe_path(f))
        except RecipeError as e:
            bad += 1
            for p in e.problems:
                typer.echo(f"error: {p}", err=True)
            continue
        except UserError as e:
            bad += 1
            typer.echo(f"error: {e}", err=True)
            continue
        typer.echo(f"ok {f}")
    if bad:
        raise typer.Exit(2)


@recipe_app.command("show")
def show(
    name: str = typer.Argument(..., help="Preset name (see `quantkit recipe list`) or a recipe file."),
    resolved: bool = typer.Option(False, "--resolved", help="Print every field with defaults filled in."),
    as_json: bool = typer.Option(False, "--json", help="Print the resolved recipe as JSON."),
):
    """Print a recipe: the file as written (copy it and edit), or with every default filled in.

    Example: quantkit recipe show w4a16-gptq > my-recipe.yaml
    """
    from ..recipe import load_recipe, resolve_recipe_path

    path = resolve_recipe_path(name)
    recipe = load_recipe(path)  # a broken file is reported, never printed as if usable
    if as_json:
        emit_json(recipe.model_dump(mode="json"))
    elif resolved:
        import yaml

        typer.echo(yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False), nl=False)
    else:
        typer.echo(path.read_text(encoding="utf-8"), nl=False)


@recipe_app.command("list")
def list_presets(as_json: bool = typer.Option(False, "--json", help="Print names and descriptions as JSON.")):
    """List the shipped recipes.

    Example: quantkit recipe list
    """
    from ..recipe import load_recipe, preset_names, recipes_dir

    rows = [{"name": n, "description": load_recipe(recipes_dir() / f"{n}.yaml").description or ""}
            for n in preset_names()]
    if as_json:
        emit_json(rows)
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"recipes in {recipes_dir()}")
    t.add_column("name")
    t.add_column("description")
    for r in rows:
        t.add_row(r["name"], r["description"])
    Console().print(t)


@app.command("run", epilog=fields_help())
def run(
    recipe: str = typer.Argument(..., help="Recipe YAML file or preset name (see `quantkit recipe list`)."),
    model: Optional[str] = typer.Option(None, "--model", help="Override the recipe's model (folder or hub id)."),
    output: Optional[str] = typer.Option(None, "-o", "--output", help="Override the recipe's output folder."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a non-empty output folder."),
    set_: Optional[list[str]] = typer.Option(
        None, "--set", help=SET_HELP),
    skip_eval: bool = typer.Option(False, "--skip-eval", help="Quantise only, even if the recipe has eval."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON summary on stdout."),
):
    """Run a recipe: quantise, then evaluate against the base model and check the gates if it has `eval`.

    Exit code 0 when every gate passes, 1 when a gate fails, 2 for a bad recipe or input.

    Example: quantkit run recipes/ci-smoke.yaml
    """
    from ..recipe import apply_overrides, load_recipe, resolve_recipe_path
    from ..recipe_run import run_recipe
    from .quantize_cmd import _progress

    overrides = parse_set(set_ or [])
    overrides.update({"model": model, "output": output, "overwrite": overwrite or None})
    r = apply_overrides(load_recipe(resolve_recipe_path(recipe)), overrides)
    prog = _progress(quiet or as_json)
    if prog is None:
        result = run_recipe(r, skip_eval=skip_eval)
    else:
        with prog:
            result = run_recipe(r, progress=prog, skip_eval=skip_eval)
    gates = result["gates"]
    if as_json:
        emit_json({k: v for k, v in result.items()})
    elif not quiet:
        q = result["quantize"]
        console.print(f"[green]wrote[/] {q['output']}: {q['layers']} layers, {q['scheme']} {q['method']}, "
                      f"{q['seconds']} s")
        if q.get("method_reason"):
            console.print(f"method {q['method_reason']}")
        if result["eval"]:
            console.print(f"[green]eval report[/] {result['eval']['report_dir']}")
        if gates:
            for f in gates["failures"]:
                console.print(f"[red]gate failed[/] {f}")
            if gates["passed"]:
                console.print(f"[green]gates passed[/] {', '.join(f'{k}={v}' for k, v in gates['thresholds'].items())}")
    if gates and not gates["passed"]:
        raise typer.Exit(1)
