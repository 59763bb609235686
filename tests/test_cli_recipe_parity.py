"""Every recipe field is reachable from the command line: `quantkit quantize --set FIELD=VALUE` sets it (checked
on the resolved recipe) and `quantize --help` lists it; the old flag spellings still work and say their --set form."""
from __future__ import annotations

import json
import re

import pytest

from quantkit.cli.set_option import field_sections

# a value unlike the default for every field quantize reads: (as typed after FIELD=, as the resolved recipe holds it)
SAMPLES = {
    "description": ("a note", "a note"), "model": ("./elsewhere", "./elsewhere"), "output": ("./out", "./out"),
    "overwrite": ("true", True), "dtype": ("float16", "float16"), "device": ("cuda:1", "cuda:1"),
    "max_memory": ("cpu=2GiB,cuda:0=70GiB", "cpu=2GiB,cuda:0=70GiB"),
    "quant.scheme": ("w8a16", "w8a16"), "quant.method": ("gptq", "gptq"), "quant.group_size": ("64", 64),
    "quant.symmetric": ("false", False), "quant.full_range": ("false", False), "quant.bits": ("4.5", 4.5),
    "quant.ignore": ("[lm_head, 're:.*gate.*']", ["lm_head", "re:.*gate.*"]),
    "quant.targets": ("[{match: 're:.*mlp.*', scheme: fp8}]",
                      [{"match": "re:.*mlp.*", "scheme": "fp8", "group_size": None, "symmetric": None}]),
    "quant.clip_search": ("true", True), "quant.kv_cache": ("fp8", "fp8"), "quant.smooth": ("true", True),
    "quant.smoothquant.alpha": ("0.5", 0.5),
    "quant.gptq.damp": ("0.05", 0.05), "quant.gptq.block_size": ("64", 64), "quant.gptq.actorder": ("off", "off"),
    "quant.gptq.static_groups": ("false", False),
    "quant.gptq.prior_tokens": ("0", 0),
    "quant.awq.grid": ("7", 7), "quant.awq.duo": ("true", True), "quant.awq.clip": ("false", False),
    "quant.awq.search_tokens": ("512", 512), "quant.awq.fallback": ("rtn", "rtn"), "quant.awq.min_gain": ("0.05", 0.05),
    "quant.awq.clip_prior_tokens": ("0", 0),
    "quant.signround.iters": ("8", 8), "quant.signround.lr": ("0.1", 0.1), "quant.signround.batch": ("4", 4),
    "quant.signround.clip": ("false", False),
    "quant.moe.calibrate_all_experts": ("true", True), "quant.moe.min_tokens": ("4", 4),
    "calibration.spec": ("wikitext2", "wikitext2"), "calibration.num_samples": ("16", 16),
    "calibration.seq_len": ("64", 64), "calibration.seed": ("3", 3), "calibration.cut": ("document", "document"),
    "calibration.text_field": ("body", "body"), "calibration.min_tokens": ("8", 8),
    "calibration.holdout": ("0.3", 0.3),
}
RUN_ONLY = ("eval", "draft")  # read by `quantkit run` (evaluation, draft training), refused by quantize


def all_fields() -> list[str]:
    return [f"{s}.{n}" if s else n for s, names in field_sections().items() for n in names]


@pytest.fixture
def resolved(cli, monkeypatch):
    """Run `quantkit quantize ARGS` up to the resolved recipe (quantising is tested elsewhere); its JSON form."""
    import quantkit.cli.quantize_cmd as cmd
    import quantkit.devices as devices

    seen = {}
    monkeypatch.setattr(cmd, "_run", lambda recipe, quiet, as_json: seen.setdefault("r", recipe))
    monkeypatch.setattr(devices, "resolve_device", lambda name: name)  # no GPU needed to name one

    def run(*args):
        seen.clear()
        code, _, err = cli("quantize", *args)
        assert code == 0, err
        return json.loads(seen["r"].model_dump_json()), err

    return run


def _get(data: dict, field: str):
    for part in field.split("."):
        data = data[part]
    return data


def test_the_samples_cover_every_field_quantize_reads():
    fields = {f for f in all_fields() if f.split(".")[0] not in RUN_ONLY}
    assert set(SAMPLES) == fields, "add a sample value here for each new recipe field"


@pytest.mark.parametrize("field", sorted(SAMPLES))
def test_set_reaches_every_field(resolved, field):
    typed, want = SAMPLES[field]
    got, _ = resolved("--set", f"{field}={typed}")
    assert _get(got, field) == want


def test_help_lists_every_field_set_takes(cli):
    code, out, _ = cli("quantize", "--help")
    assert code == 0
    text = re.sub(r"\s+", " ", out)
    listed = {f"{m.group(1)}.{n.strip()}" if m.group(1) != "top level" else n.strip()
              for m in re.finditer(r"(top level|[a-z_.]+): ((?:[a-z_]+, )*[a-z_]+)", text)
              for n in m.group(2).split(",")}
    assert {f for f in SAMPLES} <= listed
    assert "Example:" in text and "--set" in text
    options = re.findall(r"^\s*[│|]?\s*(--[a-z-]+)", out, re.M)
    assert len(set(options)) <= 20, options


def test_eval_and_draft_fields_are_for_run(cli, monkeypatch):
    code, _, err = cli("quantize", "--set", "eval.data=wikitext2")
    assert code == 2 and "quantkit run" in err and len(err.strip().splitlines()) == 1
    import quantkit.recipe_run as recipe_run

    seen = {}
    monkeypatch.setattr(recipe_run, "run_recipe", lambda r, **kw: seen.setdefault("r", r) and {"gates": None})
    code, _, err = cli("run", "ci-smoke", "--set", "eval.max_windows=3", "--set", "draft.steps=5", "--json")
    assert code == 0, err
    assert seen["r"].eval.max_windows == 3 and seen["r"].draft.steps == 5
    code, out, _ = cli("run", "--help")
    assert "eval: data" in re.sub(r"\s+", " ", out) and "draft: train" in re.sub(r"\s+", " ", out)


def test_explicit_options_win_over_set(resolved):
    got, _ = resolved("--set", "quant.group_size=32", "--group-size", "64", "--set", "calibration.seq_len=16")
    assert got["quant"]["group_size"] == 64 and got["calibration"]["seq_len"] == 16


# old spelling, value as typed, the field it sets, the value the resolved recipe should hold
OLD_FLAGS = [
    (["--awq-search-tokens", "512"], "quant.awq.search_tokens", 512),
    (["--no-awq-clip"], "quant.awq.clip", False),
    (["--no-static-groups"], "quant.gptq.static_groups", False),
    (["--damp=0.05"], "quant.gptq.damp", 0.05),
    (["--asym"], "quant.symmetric", False),
    (["--actorder", "off"], "quant.gptq.actorder", "off"),
    (["--awq-tolerance", "0.2"], "quant.awq.min_gain", 0.2),
    (["--moe-calibrate-all"], "quant.moe.calibrate_all_experts", True),
    (["--smooth-alpha", "0.3"], "quant.smoothquant.alpha", 0.3),
]


@pytest.mark.parametrize("args,field,want", OLD_FLAGS)
def test_old_flags_still_work_and_print_their_set_form(resolved, args, field, want):
    got, err = resolved("./model", *args)
    assert _get(got, field) == want and got["model"] == "./model"
    assert f"is now --set {field}=" in err


def test_removed_knobs_are_gone(cli):
    code, _, err = cli("quantize", "--signround-keep-best")
    assert code == 2
    code, _, err = cli("quantize", "--set", "quant.signround.float_targets=true")
    assert code == 2 and "float_targets" in err
