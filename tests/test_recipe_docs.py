"""docs/recipes.md is generated from the schema; a stale committed copy fails here with the command to fix it."""
from pathlib import Path

from quantkit.recipe import Recipe, preset_names
from quantkit.recipe.docs import render

DOC = Path(__file__).resolve().parents[1] / "docs" / "recipes.md"


def test_committed_reference_is_up_to_date():
    assert DOC.read_text() == render(), "docs/recipes.md is stale: python -m quantkit.recipe.docs > docs/recipes.md"


def test_reference_documents_every_field_gate_and_preset():
    text = render()
    for name, field in Recipe.model_fields.items():
        assert f"| `{name}` |" in text and field.description
    for sub in ("quant", "quant.targets[]", "quant.gptq", "quant.awq", "calibration", "eval", "eval.gates"):
        assert f"## `{sub}`" in text
    for p in preset_names():
        assert f"| `{p}` |" in text
    from quantkit.evaluate.gates import GATES

    for g in GATES:
        assert f"| `{g}` |" in text
