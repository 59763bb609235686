"""Presets: the shipped recipes/ folder, and a recipe named by path or by preset name."""
from __future__ import annotations

from pathlib import Path

from ..errors import UserError


def recipes_dir() -> Path:
    """The shipped recipes/ folder: inside an installed wheel, or the checkout's for an editable install."""
    from ..shipped import shipped_dir

    return shipped_dir("recipes")


def preset_names() -> list[str]:
    d = recipes_dir()
    return sorted(p.stem for p in d.glob("*.yaml")) if d.is_dir() else []


def resolve_recipe_path(ref: str | Path) -> Path:
    """A recipe file from a path or a preset name ('w4a16-gptq'); unknown names suggest the closest preset."""
    import difflib


    p = Path(ref).expanduser()
    if p.is_file():
        return p
    names = preset_names()
    if str(ref) in names:
        return recipes_dir() / f"{ref}.yaml"
    if p.exists():
        raise UserError(f"recipe '{p}' is not a file; pass a recipe YAML file or a preset name")
    close = difflib.get_close_matches(p.stem if p.suffix in (".yaml", ".yml") else str(ref), names, n=1)
    hint = f"did you mean the preset '{close[0]}'? " if close else ""
    raise UserError(f"recipe file '{p}' does not exist; {hint}presets: {', '.join(names) or 'none found'}")
