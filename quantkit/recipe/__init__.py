"""Recipes: the schema (strict types), YAML loading with file:line errors, presets, and CLI overrides."""
from .load import RECIPE_DIR, apply_overrides, load_recipe, parse_recipe
from .presets import preset_names, recipes_dir, resolve_recipe_path
from .schema import (AWQOptions, CalibrationOptions, DraftOptions, EvalOptions, GPTQOptions, QuantOptions, Recipe,
                     TargetOverride, known_gates)

__all__ = ["RECIPE_DIR", "apply_overrides", "load_recipe", "parse_recipe", "preset_names", "recipes_dir",
           "resolve_recipe_path", "AWQOptions", "CalibrationOptions", "DraftOptions",
           "EvalOptions", "GPTQOptions", "QuantOptions",
           "Recipe", "TargetOverride", "known_gates"]
