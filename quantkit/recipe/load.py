"""Reading recipes: YAML text or a file validated with file:line errors, and CLI overrides of dotted fields."""
from __future__ import annotations

from pathlib import Path

from ..errors import UserError
from .schema import Recipe


RECIPE_DIR = "{recipe_dir}"


def _expand_recipe_dir(value, folder: str):
    if isinstance(value, str):
        return value.replace(RECIPE_DIR, folder)
    if isinstance(value, dict):
        return {k: _expand_recipe_dir(v, folder) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand_recipe_dir(v, folder) for v in value]
    return value


def parse_recipe(text: str, source: str = "<recipe>", folder: str | Path | None = None) -> Recipe:
    """Validate recipe YAML text; every mistake is a RecipeError naming source:line and the field.

    '{recipe_dir}' in any string becomes FOLDER (the recipe file's folder), so a recipe can name data shipped
    beside it and still run from any working directory.
    """
    from .errors import RecipeError, validate_yaml

    recipe, problems = validate_yaml(text, source, Recipe)
    if problems:
        raise RecipeError(problems)
    if folder is not None and RECIPE_DIR in text:
        recipe = Recipe.model_validate(_expand_recipe_dir(recipe.model_dump(), str(Path(folder).resolve())))
    return recipe


def load_recipe(path) -> Recipe:
    """Read and validate a recipe YAML file; every mistake is a UserError naming the file, line and field."""

    p = Path(path)
    if not p.is_file():
        raise UserError(f"recipe file '{p}' does not exist; see `quantkit recipe list` for presets to copy")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{p}: not a UTF-8 text file; a recipe is YAML text") from None
    return parse_recipe(text, str(p), p.parent)


def apply_overrides(recipe: Recipe, overrides: dict) -> Recipe:
    """Set dotted fields ('quant.group_size') from CLI flags; None means 'not given'."""
    from pydantic import ValidationError

    from .errors import describe

    data = recipe.model_dump()
    for key, value in overrides.items():
        if value is None:
            continue
        node = data
        *parents, leaf = key.split(".")
        for i, k in enumerate(parents):
            if node.get(k) is None:
                node[k] = {}
            node = node[k]
            if not isinstance(node, dict):
                raise UserError(f"option {key}: '{'.'.join(parents[:i + 1])}' is not a section of the recipe")
        node[leaf] = value
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        field, msg = describe(err, Recipe)
        raise UserError(f"option {field}: {msg}") from None
