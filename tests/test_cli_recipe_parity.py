"""Every knob a recipe has, `quantkit quantize` has as a flag, and each flag sets the field it claims to."""
from __future__ import annotations

import inspect
import json

import pytest
from pydantic import BaseModel

from quantkit.cli.quantize_cmd import FLAG_FIELDS, quantize
from quantkit.recipe import Recipe

# Fields a single flag cannot express, with where the user sets them instead
NO_FLAG = {
    "description": "free text, not a knob",
    "quant.targets": "a list of per-module overrides: recipe file or `quantkit run --set`",
    "eval": "`quantkit eval` and `quantkit run` take the evaluation settings",
    "draft": "`quantkit draft train` takes the head-training settings (tests/test_draft_eagle.py checks that parity)",
}


def leaf_fields(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        sub = info.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            out += leaf_fields(sub, path + ".")
        else:
            out.append(path)
    return out


def test_every_recipe_field_has_a_quantize_flag():
    fields = [f for f in leaf_fields(Recipe) if not any(f == k or f.startswith(k + ".") for k in NO_FLAG)]
    missing = sorted(set(fields) - set(FLAG_FIELDS.values()))
    assert not missing, f"recipe fields without a `quantkit quantize` flag: {missing}"
    params = set(inspect.signature(quantize).parameters)
    assert set(FLAG_FIELDS) <= params, f"FLAG_FIELDS names that are not options: {set(FLAG_FIELDS) - params}"


# flag, value as typed, field, value the resolved recipe should hold
NEW_FLAGS = [
    ("--awq-search-tokens", "512", "quant.awq.search_tokens", 512),
    ("--no-awq-clip", None, "quant.awq.clip", False),
    ("--no-static-groups", None, "quant.gptq.static_groups", False),
    ("--awq-grid", "7", "quant.awq.grid", 7),
    ("--seq-len", "64", "calibration.seq_len", 64),
]


@pytest.mark.parametrize("flag,value,field,want", NEW_FLAGS)
def test_flag_reaches_the_resolved_recipe(cli, tmp_path, monkeypatch, flag, value, field, want):
    seen = {}
    import quantkit.cli.quantize_cmd as cmd

    # stop at the resolved recipe: what the flag set is the point here, quantising is tested elsewhere
    monkeypatch.setattr(cmd, "_run", lambda recipe, quiet, as_json: seen.setdefault("r", recipe))
    args = ["quantize", "-o", tmp_path / "o", flag] + ([value] if value is not None else [])
    code, _, err = cli(*args)
    assert code == 0, err
    got = json.loads(seen["r"].model_dump_json())
    for part in field.split("."):
        got = got[part]
    assert got == want
