"""The calibration hold-out (capture/holdout.py): one share, calibration.holdout, the last whole samples of the
whole calibration set, the same ones for every guard and on every torchrun rank; the old per-solver keys still
set it for one release and say the new form."""
from __future__ import annotations

import json

import pytest
from helpers import make_tiny_model
from test_data_support import SAMPLE, tiny_tokenizer

from quantkit import distributed
from quantkit.capture import holdout
from quantkit.recipe import Recipe, apply_overrides, load_recipe


# the rule as written: round(n * share) of the last samples, at least one for a positive share, never all
@pytest.mark.parametrize("n, share, held", [(10, 0.1, 1), (10, 0.2, 2), (8, 0.125, 1), (128, 0.1, 13),
                                            (128, 0.2, 26), (5, 0.01, 1), (3, 0.99, 2), (1, 0.5, 0), (10, 0, 0)])
def test_one_process_holds_out_the_last_samples(n, share, held):
    kept, out = holdout.split(n, share)
    assert kept == list(range(n - held))
    assert out == (list(range(n - held, n)) if held else None)


class _Ranks:
    """distributed as seen by rank R of W (samples dealt as distributed.shard deals them), without a process
    group: counts are summed over the W ranks' shares, which is what Pool.count's all-reduce returns."""

    def __init__(self, monkeypatch, world: int, rank: int, n_all: int):
        monkeypatch.setattr(distributed, "active", lambda: True)
        monkeypatch.setattr(distributed, "world", lambda: world)
        monkeypatch.setattr(distributed, "rank", lambda: rank)
        monkeypatch.setattr(distributed.Pool, "count", staticmethod(lambda n: n_all))
        self.mine = list(range(n_all))[rank::world]


@pytest.mark.parametrize("world, n_all, share", [(2, 10, 0.2), (3, 10, 0.1), (4, 9, 0.3), (3, 7, 0.125)])
def test_ranks_hold_out_exactly_what_one_process_does(monkeypatch, world, n_all, share):
    want = set(range(n_all - holdout.held_out_count(n_all, share), n_all))
    held_global, kept_global = set(), set()
    for rank in range(world):
        r = _Ranks(monkeypatch, world, rank, n_all)
        kept, held = holdout.split(len(r.mine), share)
        assert held is not None  # every rank takes part in the guard, even one holding none of its samples
        held_global |= {r.mine[j] for j in held}
        kept_global |= {r.mine[j] for j in kept}
    assert held_global == want and kept_global == set(range(n_all)) - want


def _model(tmp_path):
    folder = make_tiny_model(tmp_path / "tiny", "llama", layers=1)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def test_every_guard_judges_on_the_one_share(tmp_path, cli):
    """awq+gptq: GPTQ's guard gets the held-out samples' tokens, AWQ's guard runs; learned rounding holds out
    the same count. 10 samples of 16 tokens at calibration.holdout 0.3: the last 3 (48 tokens)."""
    src = _model(tmp_path)
    common = ["--group-size", "32", "--calib", SAMPLE, "--num-samples", "10", "--seq-len", "16", "-q",
              "--set", "calibration.holdout=0.3", "--set", "quant.signround.iters=2"]
    metas = {}
    for method in ("awq+gptq", "signround"):
        out = tmp_path / method
        code, _, err = cli("quantize", src, "-o", out, "--method", method, *common)
        assert code == 0, err
        metas[method] = json.loads((out / "quantkit.json").read_text())["layers"]
    down = metas["awq+gptq"]["model.layers.0.mlp.down_proj"]
    assert down["holdout_tokens"] == 48 and "awq_guard" in down
    assert metas["signround"]["model.layers.0.mlp.down_proj"]["signround_heldout_samples"] == 3


@pytest.mark.parametrize("old", ["quant.awq.holdout", "quant.gptq.holdout", "quant.signround.holdout"])
def test_old_keys_set_the_one_share_and_say_the_new_form(tmp_path, old):
    with pytest.warns(FutureWarning, match=r"--set calibration.holdout=0.3"):
        r = apply_overrides(Recipe(), {old: 0.3})
    assert r.calibration.holdout == 0.3 and "holdout" not in r.model_dump()["quant"][old.split(".")[1]]
    path = tmp_path / "old.yaml"
    path.write_text(f"quant:\n  {old.split('.')[1]}:\n    holdout: 0.25\n", encoding="utf-8")
    with pytest.warns(FutureWarning, match="calibration.holdout"):
        assert load_recipe(path).calibration.holdout == 0.25


def test_old_keys_that_disagree_are_refused(cli, tmp_path):
    code, _, err = cli("quantize", tmp_path, "-o", tmp_path / "o", "--set", "quant.awq.holdout=0.2",
                       "--set", "quant.gptq.holdout=0.1")
    assert code == 2 and "calibration.holdout once" in err and len(err.strip().splitlines()) == 1


def test_old_flags_become_the_one_share(cli, tmp_path, monkeypatch):
    import quantkit.cli.quantize_cmd as cmd

    seen = {}
    monkeypatch.setattr(cmd, "_run", lambda recipe, quiet, as_json: seen.setdefault("r", recipe))
    code, _, err = cli("quantize", tmp_path, "-o", tmp_path / "o", "--awq-holdout", "0.3")
    assert code == 0, err
    assert seen["r"].calibration.holdout == 0.3 and "--set calibration.holdout=0.3" in err


def test_the_share_is_a_calibration_field_only():
    from quantkit.solvers.awq_options import AWQOptions
    from quantkit.solvers.gptq_options import GPTQOptions
    from quantkit.solvers.signround_options import SignRoundOptions

    assert not any("holdout" in o.model_fields for o in (AWQOptions, GPTQOptions, SignRoundOptions))
    assert Recipe().calibration.holdout == holdout.HOLDOUT
