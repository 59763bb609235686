"""Where quantize may write: never over a user's files or the source, one writer per OUT, modes kept.

Each case here was a way to lose data or crash after all the work: `-o . --overwrite` deleting the working
folder, `-o SRC --overwrite` replacing the float model, two runs on one OUT both "succeeding", a read-only OUT
failing with a traceback at the end, a config.json that does not match its weights being built at full size.
"""
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from helpers import make_tiny_model, tree_hash


def _one_line_error(code, err, *needles):
    assert code == 2, err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.fixture
def src(tmp_path):
    return make_tiny_model(tmp_path / "models" / "tiny", "llama")


def test_dot_overwrite_in_a_folder_holding_the_source(tmp_path, src, cli, monkeypatch):
    (tmp_path / "notes.txt").write_text("mine")
    before = tree_hash(tmp_path)
    monkeypatch.chdir(tmp_path)
    code, _, err = cli("quantize", "--method", "rtn", "models/tiny", "-o", ".", "--overwrite", "--group-size", "32", "--quiet")
    _one_line_error(code, err, "contains the source model", "-o")
    assert tree_hash(tmp_path) == before


def test_dot_overwrite_in_a_folder_of_other_files(tmp_path, src, cli, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    monkeypatch.chdir(work)
    code, _, err = cli("quantize", "--method", "rtn", src, "-o", ".", "--overwrite", "--group-size", "32", "--quiet")
    _one_line_error(code, err, "not a quantkit checkpoint", "choose another -o path")
    assert (work / "notes.txt").read_text() == "mine" and sorted(p.name for p in work.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("where, needle", [("", "is the source model"), ("sub", "is inside the source model")])
def test_output_is_or_is_inside_the_source(src, cli, where, needle):
    before = tree_hash(src)
    code, _, err = cli("quantize", "--method", "rtn", src, "-o", src / where if where else src, "--overwrite", "--quiet")
    _one_line_error(code, err, needle)
    assert tree_hash(src) == before and not (src / "sub").exists()


def test_overwrite_refuses_a_folder_quantkit_did_not_write(tmp_path, src, cli):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    code, _, err = cli("quantize", "--method", "rtn", src, "-o", out, "--group-size", "32", "--overwrite", "--quiet")
    _one_line_error(code, err, "not a quantkit checkpoint", "quantkit.json")
    assert (out / "keep.txt").read_text() == "precious"


def test_overwrite_replaces_a_checkpoint_and_keeps_its_mode(tmp_path, src, cli):
    out = tmp_path / "out"
    assert cli("quantize", "--method", "rtn", src, "-o", out, "--group-size", "32", "--quiet")[0] == 0
    code, _, err = cli("quantize", "--method", "rtn", src, "-o", out, "--group-size", "64", "--quiet")
    _one_line_error(code, err, "not empty", "--overwrite")
    os.chmod(out, 0o751)
    assert cli("quantize", "--method", "rtn", src, "-o", out, "--group-size", "64", "--overwrite", "--quiet")[0] == 0
    assert json.loads((out / "quantkit.json").read_text())["recipe"]["quant"]["group_size"] == 64
    assert os.stat(out).st_mode & 0o777 == 0o751
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")]
    assert leftovers == [], leftovers  # no partial, old or lock folder left beside OUT


@pytest.mark.parametrize("umask, mode", [(0o022, 0o755), (0o027, 0o750)])
def test_new_checkpoint_follows_the_umask(tmp_path, src, cli, umask, mode):
    old = os.umask(umask)
    try:
        assert cli("quantize", "--method", "rtn", src, "-o", tmp_path / "out", "--group-size", "32", "--quiet")[0] == 0
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "out").st_mode & 0o777 == mode
    files = {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / "out").iterdir()}
    assert "model.safetensors" in files and set(files.values()) == {mode & 0o666}, files


def test_empty_output_folder_is_used(tmp_path, src, cli):
    (tmp_path / "out").mkdir()
    assert cli("quantize", "--method", "rtn", src, "-o", tmp_path / "out", "--group-size", "32", "--quiet")[0] == 0
    assert (tmp_path / "out" / "quantkit.json").is_file()


def test_unwritable_parent_fails_before_any_work(src, cli):
    # sysfs refuses new files even to root, so this holds whoever runs the suite
    code, _, err = cli("quantize", "--method", "rtn", src, "-o", "/sys/quantkit-out", "--group-size", "32", "--quiet")
    _one_line_error(code, err, "cannot write in '/sys'", "writable -o path")


def test_read_only_mount(tmp_path, src):
    """A real read-only file system (a bind mount in a private mount namespace): one line, exit 2, up front."""
    ro = tmp_path / "ro"
    ro.mkdir()
    script = textwrap.dedent(f"""
        set -e
        mount --bind {ro} {ro}
        mount -o remount,bind,ro {ro}
        {sys.executable} -c "from quantkit.cli import main; main()" quantize {src} -o {ro}/out --group-size 32 -q
    """)
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=300)
    _one_line_error(proc.returncode, proc.stderr, "cannot write in", "Read-only file system")
    assert not (ro / "out").exists()


_SLOW_WRITER = """
import os, sys, time
import quantkit.formats.writer as w
real = w.save_tensors
inside, go = sys.argv[1], sys.argv[2]
def slow(folder, specs, tensors):
    open(inside, "w").close()                 # tell the test we are inside the write, holding the lock
    while not os.path.exists(go):             # until the test says go on
        time.sleep(0.05)
    real(folder, specs, tensors)
w.save_tensors = slow
sys.argv = ["quantkit", "quantize", "--method", "rtn", sys.argv[3], "-o", sys.argv[4], "--quiet", "--group-size", "32"]
from quantkit.cli import main
main()
"""


def test_two_writers_on_one_output(tmp_path, src, cli):
    out, inside, go = tmp_path / "out", tmp_path / "inside", tmp_path / "go"
    first = subprocess.Popen([sys.executable, "-c", _SLOW_WRITER, inside, go, src, out],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(1200):
            if inside.exists() or first.poll() is not None:
                break
            time.sleep(0.1)
        assert inside.exists(), first.communicate()[1]
        code, _, err = cli("quantize", "--method", "rtn", src, "-o", out, "--group-size", "64", "--quiet")
        _one_line_error(code, err, "another quantkit run", str(first.pid))
        code, _, err = cli("quantize", "--method", "rtn", src, "-o", out, "--group-size", "64", "--overwrite", "--quiet")
        _one_line_error(code, err, "another quantkit run")
    finally:
        go.touch()
        _, first_err = first.communicate(timeout=300)
    assert first.returncode == 0, first_err
    assert json.loads((out / "quantkit.json").read_text())["recipe"]["quant"]["group_size"] == 32


def test_final_rename_replaces_nothing_it_did_not_claim(tmp_path, src, cli, monkeypatch):
    """Something other than quantkit creates OUT during the run: the rename must not replace it."""
    import quantkit.formats.writer as w

    out = tmp_path / "out"
    real = w.save_tensors

    def intruder(folder, specs, tensors):
        out.mkdir()
        (out / "theirs.txt").write_text("not ours")
        real(folder, specs, tensors)

    monkeypatch.setattr(w, "save_tensors", intruder)
    code, _, err = cli("quantize", "--method", "rtn", src, "-o", out, "--group-size", "32", "--quiet")
    _one_line_error(code, err, "changed while quantising", "nothing was replaced")
    assert sorted(p.name for p in out.iterdir()) == ["theirs.txt"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.partial")]


def test_empty_folder_filled_during_the_run_is_kept(tmp_path, src, cli, monkeypatch):
    import quantkit.formats.writer as w

    out = tmp_path / "out"
    out.mkdir()
    real = w.save_tensors

    def filler(folder, specs, tensors):
        (out / "late.txt").write_text("arrived during the run")
        real(folder, specs, tensors)

    monkeypatch.setattr(w, "save_tensors", filler)
    code, _, err = cli("quantize", "--method", "rtn", src, "-o", out, "--group-size", "32", "--quiet")
    _one_line_error(code, err, "changed while quantising")
    assert (out / "late.txt").read_text() == "arrived during the run"


def test_rename_noreplace_refuses_an_empty_folder(tmp_path):
    """Plain rename(2) replaces an empty folder; the final step must not."""
    from quantkit.errors import UserError
    from quantkit.formats.output import _rename_noreplace

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x").write_text("x")
    (tmp_path / "b").mkdir()
    with pytest.raises(UserError, match="appeared while quantising"):
        _rename_noreplace(tmp_path / "a", tmp_path / "b")
    assert (tmp_path / "a" / "x").exists() and not any((tmp_path / "b").iterdir())
    _rename_noreplace(tmp_path / "a", tmp_path / "c")
    assert (tmp_path / "c" / "x").exists()


# ---- config.json against the weights ----------------------------------------------------------------------

def test_default_config_beside_small_weights(tmp_path, src, cli):
    """`{"model_type": "llama"}` describes a 7B model: refused from the headers, nothing allocated."""
    (src / "config.json").write_text(json.dumps({"model_type": "llama"}))
    code, _, err = cli("quantize", "--method", "rtn", src, "-o", tmp_path / "out", "--quiet")
    _one_line_error(code, err, "does not match its weights", "model.embed_tokens.weight is [512, 128]",
                    "[32000, 4096]", "fix config.json")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("method", ["rtn", "gptq"])  # gptq with self-calibration loads the whole model
def test_small_config_mismatch(tmp_path, src, cli, method):
    cfg = json.loads((src / "config.json").read_text())
    cfg["intermediate_size"] = 320
    (src / "config.json").write_text(json.dumps(cfg))
    code, _, err = cli("quantize", src, "-o", tmp_path / "out", "--method", method, "--quiet")
    _one_line_error(code, err, "does not match its weights", "mlp", "[320, 128]")


def test_config_with_more_layers_than_the_weights(tmp_path, src, cli):
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_hidden_layers"] = 6
    (src / "config.json").write_text(json.dumps(cfg))
    code, _, err = cli("quantize", "--method", "rtn", src, "-o", tmp_path / "out", "--quiet")
    _one_line_error(code, err, "safetensors files in", "lack model.layers.2.", "and ", "config.json")


def test_matching_tied_model_passes_the_check(tmp_path):
    from transformers import AutoModelForCausalLM

    from helpers import tiny_config
    from quantkit.models.hf import load_float_model

    cfg = tiny_config("qwen2")
    cfg.tie_word_embeddings = True
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "qwen")
    from safetensors import safe_open

    with safe_open(tmp_path / "qwen" / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()  # a tied head is saved once, as the embedding
    model, _, _ = load_float_model(str(tmp_path / "qwen"))
    assert model.lm_head.weight is model.model.embed_tokens.weight


# ---- paths and recipes ------------------------------------------------------------------------------------

def test_mistyped_relative_path_is_not_a_hub_id(tmp_path, src, cli, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = cli("quantize", "--method", "rtn", "models/tny", "-o", "out")
    _one_line_error(code, err, "model folder 'models/tny' does not exist")


@pytest.mark.parametrize("yaml_text, field", [
    ("quant:\n  group_size: true\n", "group_size"),
    ("quant:\n  symmetric: \"yes\"\n", "symmetric"),
    ("calibration:\n  num_samples: \"64\"\n", "num_samples"),
    ("overwrite: 1\n", "overwrite"),
])
def test_recipe_types_are_not_coerced(yaml_text, field):
    from quantkit.recipe import parse_recipe
    from quantkit.recipe.errors import RecipeError

    with pytest.raises(RecipeError) as e:
        parse_recipe(yaml_text, "r.yaml")
    assert field in str(e.value) and "r.yaml:" in str(e.value)


def _quantize(cli, src, out, *extra):
    return cli("quantize", "--method", "rtn", src, "-o", out, "--group-size", "32", "--quiet", *extra)


@pytest.mark.parametrize("atomic_swap", [True, False])
def test_overwrite_swaps_in_one_step_or_two_and_leaves_nothing(tmp_path, src, cli, monkeypatch, atomic_swap):
    """Where the file system swaps two folders atomically OUT is never missing; where it cannot, the two-rename
    fallback must still leave exactly one checkpoint and no leftovers."""
    import quantkit.formats.output as output

    out = tmp_path / "out"
    assert _quantize(cli, src, out)[0] == 0
    if not atomic_swap:
        monkeypatch.setattr(output, "_exchange", lambda a, b: False)
    assert _quantize(cli, src, out, "--group-size", "64", "--overwrite")[0] == 0
    assert json.loads((out / "quantkit.json").read_text())["recipe"]["quant"]["group_size"] == 64
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models", "out"]


def test_a_run_killed_between_the_two_renames_loses_nothing(tmp_path, src, cli):
    """The fallback swap renames OUT to .OUT.old-PID, then the new one to OUT. Killed in between, OUT is missing
    and the previous checkpoint sits in .OUT.old-PID: the next run puts it back before anything else, so a run
    without --overwrite refuses (as it would have) and the user's checkpoint is where they left it."""
    out = tmp_path / "out"
    assert _quantize(cli, src, out)[0] == 0
    before = tree_hash(out)
    os.rename(out, tmp_path / ".out.old-4242")
    code, _, err = _quantize(cli, src, out)
    _one_line_error(code, err, "--overwrite")
    assert tree_hash(out) == before and not (tmp_path / ".out.old-4242").exists()


def test_a_run_killed_after_the_swap_leaves_the_old_copy_for_the_next_to_drop(tmp_path, src, cli):
    out = tmp_path / "out"
    assert _quantize(cli, src, out)[0] == 0
    (tmp_path / ".out.old-4242").mkdir()
    (tmp_path / ".out.old-4242" / "model.safetensors").write_bytes(b"old")
    (tmp_path / ".out.old-x").mkdir()  # not a name quantkit writes: kept
    assert _quantize(cli, src, out, "--overwrite")[0] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.old-x", "models", "out"]
