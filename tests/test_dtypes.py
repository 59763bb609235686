"""Issue 38.4: one table of dtype names (quantkit/dtypes.py). Every place a user names a dtype accepts the same
names: the recipe's fields, --dtype and quantkit.load; an unknown one is one line naming the choices."""
import typing

import pytest
import torch

from quantkit.dtypes import AUTO, DTYPES, parse_dtype, stored_dtype
from quantkit.errors import UserError
from quantkit.recipe.schema import EvalOptions, Recipe


def _names(annotation) -> set[str]:
    return {a for arg in typing.get_args(annotation) for a in (typing.get_args(arg) or [arg]) if isinstance(a, str)}


def test_recipe_fields_take_the_table_names():
    assert _names(Recipe.model_fields["dtype"].annotation) == set(DTYPES) | {AUTO}
    assert _names(EvalOptions.model_fields["dtype"].annotation) == set(DTYPES)


def test_parse_and_stored_names():
    assert parse_dtype("bfloat16") is torch.bfloat16 and parse_dtype(AUTO) is None and parse_dtype(None) is None
    assert parse_dtype(torch.float16) is torch.float16
    assert stored_dtype("torch.float16") is torch.float16 and stored_dtype(None) is torch.float32
    with pytest.raises(UserError, match=r"^unknown dtype 'fp16'; choose one of: float32, float16, bfloat16, auto$"):
        parse_dtype("fp16")
