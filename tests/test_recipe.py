"""Recipe schema: shipped presets validate, every kind of mistake names file, line and field, overrides apply."""
from __future__ import annotations

import pytest

from quantkit.errors import UserError
from quantkit.recipe import (Recipe, apply_overrides, load_recipe, parse_recipe, preset_names, recipes_dir,
                             resolve_recipe_path)
from quantkit.recipe.errors import RecipeError

REQUIRED_PRESETS = {"w4a16-rtn", "w4a16-gptq", "w4a16-awq", "w8a16", "fp8-dynamic", "fp8-kv", "mixed-attn8-mlp4",
                    "ci-smoke"}


def _problems(tmp_path, text: str, name: str = "r.yaml") -> list[str]:
    p = tmp_path / name
    p.write_text(text)
    with pytest.raises(RecipeError) as e:
        load_recipe(p)
    assert str(e.value).startswith(f"{p}:")  # the one-line CLI message names the file too
    return e.value.problems


# ---- shipped recipes ---------------------------------------------------------------------------------------

def test_required_presets_ship():
    assert REQUIRED_PRESETS <= set(preset_names())


@pytest.mark.parametrize("name", sorted(REQUIRED_PRESETS))
def test_each_preset_validates_and_describes_itself(name):
    r = load_recipe(resolve_recipe_path(name))
    assert r.description and r.output


def test_presets_say_what_their_names_promise():
    get = lambda n: load_recipe(recipes_dir() / f"{n}.yaml").quant  # noqa: E731
    assert (get("w4a16-rtn").scheme, get("w4a16-rtn").method) == ("w4a16", "rtn")
    assert (get("w4a16-gptq").scheme, get("w4a16-gptq").method) == ("w4a16", "gptq")
    assert (get("w4a16-awq").scheme, get("w4a16-awq").method) == ("w4a16", "awq")
    assert get("w8a16").scheme == "w8a16"
    assert get("fp8-dynamic").scheme == "fp8-dynamic" and get("fp8-dynamic").kv_cache is None
    assert get("fp8-kv").kv_cache == "fp8"
    mixed = get("mixed-attn8-mlp4")
    assert mixed.scheme == "w4a16" and [t.scheme for t in mixed.targets] == ["w8a16"]


def test_ci_smoke_is_quick_embedded_and_gated():
    r = load_recipe(recipes_dir() / "ci-smoke.yaml")
    assert r.model is None  # the embedded model: nothing to download in CI
    assert r.quant.method in ("rtn", "gptq") and r.quant.group_size == 64
    assert r.eval is not None and r.eval.gates
    # {recipe_dir} is expanded to the recipe's own folder, so the eval text is found from any working directory
    assert r.eval.data == str(recipes_dir().resolve() / "data" / "ci-smoke-eval.txt")
    assert (recipes_dir() / "data" / "ci-smoke-eval.txt").is_file()


# ---- each kind of mistake --------------------------------------------------------------------------------

def test_misspelt_key_names_line_field_and_closest_name(tmp_path):
    [msg] = _problems(tmp_path, "model: x\nquant:\n  method: rtn\n  sheme: w8a16\n")
    assert msg.startswith(f"{tmp_path / 'r.yaml'}:4: quant.sheme: unknown field 'sheme'")
    assert "did you mean 'scheme'?" in msg and "valid fields here: scheme, method" in msg


def test_misspelt_top_level_and_nested_keys_are_both_reported_in_file_order(tmp_path):
    probs = _problems(tmp_path, "quant:\n  gptq:\n    dampp: 0.1\nmodle: x\n")
    assert [p.split(": ")[0].rsplit(":", 1)[1] for p in probs] == ["3", "4"]
    assert "quant.gptq.dampp" in probs[0] and "did you mean 'damp'?" in probs[0]
    assert "modle" in probs[1] and "did you mean 'model'?" in probs[1]


def test_misspelt_scheme_suggests_closest_scheme(tmp_path):
    [msg] = _problems(tmp_path, "quant:\n  scheme: w4a61\n")
    from typing import get_args

    from quantkit.recipe.schema import SchemeName

    # every scheme the schema accepts is offered, in its order
    assert f":2: quant.scheme: expected one of {', '.join(get_args(SchemeName))}, got 'w4a61'" in msg
    assert msg.endswith("did you mean 'w4a16'?")


def test_misspelt_scheme_inside_a_target_points_at_its_line(tmp_path):
    text = ("quant:\n  targets:\n    - match: 're:.*mlp.*'\n      scheme: w4a16\n"
            "    - match: attn\n      scheme: w8a61\n")
    [msg] = _problems(tmp_path, text)
    assert ":6: quant.targets[1].scheme:" in msg and "did you mean 'w8a16'?" in msg


def test_misspelt_method_suggests_closest_method(tmp_path):
    [msg] = _problems(tmp_path, "quant:\n  method: gtpq\n")
    assert ":2: quant.method:" in msg and "did you mean 'gptq'?" in msg


def test_wrong_type_says_what_was_expected(tmp_path):
    [msg] = _problems(tmp_path, "quant:\n  scheme: w4a16\n  group_size: sixty-four\n")
    assert ":3: quant.group_size: expected a valid integer" in msg and "'sixty-four'" in msg


def test_section_given_a_scalar_lists_its_fields(tmp_path):
    [msg] = _problems(tmp_path, "model: m\nquant: 4\n")
    assert ":2: quant: expected a mapping of fields (scheme, method," in msg


def test_out_of_range_value_says_the_bound(tmp_path):
    [msg] = _problems(tmp_path, "quant:\n  gptq:\n    damp: 2.0\n")
    assert ":3: quant.gptq.damp: expected less than 1; got 2.0" in msg
    [msg] = _problems(tmp_path, "calibration:\n  num_samples: 0\n")
    assert ":2: calibration.num_samples: expected greater than or equal to 1; got 0" in msg


def test_group_size_not_a_power_of_two(tmp_path):
    [msg] = _problems(tmp_path, "quant:\n  targets:\n    - match: mlp\n      scheme: w4a16\n      group_size: 48\n")
    assert ":5: quant.targets[0].group_size: group_size must be a power of two" in msg and "(got 48)" in msg


def test_bad_yaml_syntax_names_the_line(tmp_path):
    [msg] = _problems(tmp_path, "model: x\nquant:\n  scheme: w4a16\n   method: rtn\n")
    assert msg.startswith(f"{tmp_path / 'r.yaml'}:4: not valid YAML")
    [msg] = _problems(tmp_path, "quant: {scheme: w4a16\n")
    assert "not valid YAML" in msg


def test_missing_file_is_a_user_error_naming_it(tmp_path):
    with pytest.raises(UserError, match="recipe file '.*nope.yaml' does not exist"):
        load_recipe(tmp_path / "nope.yaml")


def test_unknown_preset_name_suggests_closest():
    with pytest.raises(UserError, match="did you mean the preset 'w4a16-gptq'"):
        resolve_recipe_path("w4a16-gtpq")


def test_unknown_gate_suggests_closest_and_points_at_its_key(tmp_path):
    [msg] = _problems(tmp_path, "eval:\n  data: x.txt\n  gates:\n    min_agreement: 0.9\n    max_ppl_increse: 0.1\n")
    assert ":5: eval.gates.max_ppl_increse: unknown gate" in msg and "did you mean 'max_ppl_increase'?" in msg


def test_gate_threshold_must_be_a_number(tmp_path):
    [msg] = _problems(tmp_path, "eval:\n  data: x.txt\n  gates:\n    max_kl_p99: lots\n")
    assert ":4: eval.gates.max_kl_p99: expected a valid number" in msg


def test_eval_without_data_or_tasks(tmp_path):
    [msg] = _problems(tmp_path, "eval:\n  seq_len: 64\n")
    assert ":2: eval: eval needs 'data'" in msg


def test_missing_required_target_field(tmp_path):
    [msg] = _problems(tmp_path, "quant:\n  targets:\n    - scheme: w8a16\n")
    assert ":3: quant.targets[0].match: required field is missing" in msg


def test_duplicate_key_is_an_error_not_last_wins(tmp_path):
    [msg] = _problems(tmp_path, "quant:\n  scheme: w4a16\n  scheme: w8a16\n")
    assert ":3: quant.scheme: given twice (first on line 2)" in msg


def test_top_level_must_be_a_mapping(tmp_path):
    [msg] = _problems(tmp_path, "- w4a16\n- rtn\n")
    assert ":1: expected a mapping of recipe fields" in msg


def test_one_line_message_counts_the_rest(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("modle: x\nquant:\n  sheme: w4a16\n")
    with pytest.raises(RecipeError, match=r"\(and 1 more; `quantkit recipe validate FILE` lists them all\)$"):
        load_recipe(p)


def test_empty_file_is_all_defaults(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("# nothing set\n")
    assert load_recipe(p) == Recipe()


# ---- overrides ---------------------------------------------------------------------------------------------

def test_overrides_win_over_the_file_and_none_means_not_given():
    r = parse_recipe("quant:\n  scheme: w4a16\n  group_size: 64\n  gptq:\n    damp: 0.02\n")
    o = apply_overrides(r, {"quant.group_size": 32, "quant.scheme": None, "quant.gptq.damp": 0.05,
                            "eval.data": "t.txt"})
    assert (o.quant.group_size, o.quant.scheme, o.quant.gptq.damp) == (32, "w4a16", 0.05)
    assert o.eval.data == "t.txt" and r.quant.group_size == 64  # the original is untouched


def test_override_of_unknown_field_suggests_closest():
    with pytest.raises(UserError, match=r"option quant\.sheme: unknown field 'sheme'; did you mean 'scheme'\?"):
        apply_overrides(Recipe(), {"quant.sheme": "w8a16"})


def test_override_with_bad_value_says_what_was_expected():
    with pytest.raises(UserError, match=r"option quant\.scheme: expected one of .* got 'w9'"):
        apply_overrides(Recipe(), {"quant.scheme": "w9"})
    with pytest.raises(UserError, match="'quant.scheme' is not a section"):
        apply_overrides(Recipe(), {"quant.scheme.bits": 4})


def test_recipe_dir_is_expanded_only_for_files(tmp_path):
    (tmp_path / "sub").mkdir()
    p = tmp_path / "sub" / "r.yaml"
    p.write_text("output: '{recipe_dir}/out'\ncalibration:\n  spec: '{recipe_dir}/calib.txt'\n")
    r = load_recipe(p)
    assert r.output == f"{(tmp_path / 'sub').resolve()}/out"
    assert r.calibration.spec == f"{(tmp_path / 'sub').resolve()}/calib.txt"


def test_actorder_group_is_refused_with_the_fix(cli, tmp_path):
    """Current vLLM and compressed-tensors refuse g_idx (dynamic group) act-order checkpoints, so no recipe or
    flag may write one; the error points at 'weight'."""
    from quantkit.recipe import parse_recipe

    with pytest.raises(RecipeError, match=r"r.yaml:4: quant.gptq.actorder: .*refuse.*use 'weight'"):
        parse_recipe("quant:\n  method: gptq\n  gptq:\n    actorder: group\n", "r.yaml")
    code, _, err = cli("quantize", "-o", tmp_path / "o", "--method", "gptq", "--set", "quant.gptq.actorder=group")
    assert code == 2 and "use 'weight'" in err and len(err.strip().splitlines()) == 1
    assert parse_recipe("quant:\n  gptq:\n    actorder: weight\n").quant.gptq.actorder == "weight"


def test_gptq_defaults_to_act_order_weight():
    """The measured best (docs/benchmarks.md): GPTQ without flags orders columns by the Hessian, static groups,
    so the checkpoint still has no g_idx; --actorder off turns it off."""
    from helpers import tiny_model

    from quantkit.plan import build_plan
    from quantkit.recipe import Recipe, apply_overrides

    model = tiny_model("llama")
    gptq = apply_overrides(Recipe(), {"quant.method": "gptq", "quant.group_size": 32})
    assert gptq.quant.gptq.actorder == "weight"
    assert {s.actorder for s in build_plan(model, gptq).schemes.values()} == {"weight"}
    off = apply_overrides(gptq, {"quant.gptq.actorder": "off"})
    assert {s.actorder for s in build_plan(model, off).schemes.values()} == {None}
    rtn = apply_overrides(Recipe(), {"quant.method": "rtn", "quant.group_size": 32})  # act-order needs GPTQ
    assert {s.actorder for s in build_plan(model, rtn).schemes.values()} == {None}


def test_fp8_gptq_keeps_column_order_under_the_default():
    """Act-order is for integer grids; on FP8 it was measured to cost perplexity, so the new default leaves FP8
    GPTQ in natural column order while integer Linears of the same run get act-order."""
    import torch
    from helpers import tiny_model

    from quantkit.plan import build_plan
    from quantkit.recipe import Recipe, apply_overrides

    model = tiny_model("llama")
    r = apply_overrides(Recipe(), {"quant.method": "gptq", "quant.group_size": 32,
                                   "quant.targets": [{"match": "re:.*mlp\\..*", "scheme": "fp8"}]})
    plan = build_plan(model, r)
    w = torch.randn(256, 128)
    fp8 = plan.make_solver("model.layers.0.mlp.gate_proj", w)
    integer = plan.make_solver("model.layers.0.self_attn.q_proj", torch.randn(128, 128))
    assert fp8.actorder() is None and integer.actorder() == "weight"


def test_guards_and_awq_min_gain_default_to_the_measured_settings():
    """docs/benchmarks-history.md, "Across domains": AWQ keeps the mildest alpha within 10% of the best; every
    guard (GPTQ's act-order/RTN check, AWQ's, learned rounding's) judges on the last 10% of the calibration
    samples (GPTQ's measured share); each can be turned off."""
    from quantkit.plan import build_plan
    from quantkit.recipe import Recipe, apply_overrides
    from helpers import tiny_model

    r = Recipe()
    assert (r.quant.awq.min_gain, r.calibration.holdout) == (0.1, 0.1)
    r = apply_overrides(Recipe(), {"quant.method": "awq+gptq", "calibration.holdout": 0, "quant.awq.min_gain": 0})
    plan = build_plan(tiny_model("llama"), r)
    assert plan.awq.min_gain == 0 and plan.recipe.calibration.holdout == 0


def test_awq_tolerance_is_an_old_name_for_min_gain(tmp_path):
    """Recipes written before the rename keep their meaning, with a warning naming the new key."""
    from quantkit.recipe import Recipe, apply_overrides, load_recipe

    path = tmp_path / "old.yaml"
    path.write_text("quant:\n  awq:\n    tolerance: 0.05\n", encoding="utf-8")
    with pytest.warns(FutureWarning, match="quant.awq.min_gain"):
        assert load_recipe(path).quant.awq.min_gain == 0.05
    with pytest.warns(FutureWarning, match="quant.awq.min_gain"):
        assert apply_overrides(Recipe(), {"quant.awq.tolerance": 0.3}).quant.awq.min_gain == 0.3
    assert "tolerance" not in Recipe().quant.awq.model_dump()
