"""Bad input: one clear line on stderr, exit code 2, nothing written, the source untouched."""
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from helpers import make_tiny_model, tree_hash


def _one_line_error(code, err, *needles):
    assert code == 2, err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for n in needles:
        assert n in lines[0], lines[0]


def test_missing_model_folder(tmp_path, cli):
    code, _, err = cli("quantize", tmp_path / "nope", "-o", tmp_path / "out")
    _one_line_error(code, err, "does not exist")
    assert not (tmp_path / "out").exists()


def test_not_a_model_folder(tmp_path, cli):
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "notes.txt").write_text("hello")
    code, _, err = cli("quantize", tmp_path / "folder", "-o", tmp_path / "out")
    _one_line_error(code, err, "no config.json")


def test_hub_id_offline(tmp_path, cli, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, _, err = cli("quantize", "SomeOrg/not-a-cached-model", "-o", tmp_path / "out")
    _one_line_error(code, err, "SomeOrg/not-a-cached-model", "local folder")


def test_unsupported_architecture(tmp_path, cli):
    from transformers import ViTConfig

    ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2).save_pretrained(tmp_path / "vit")
    code, _, err = cli("quantize", tmp_path / "vit", "-o", tmp_path / "out")
    _one_line_error(code, err, "'vit'", "llama", "qwen2", "opt")


def test_conv1d_architecture(tmp_path, cli):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=100)).save_pretrained(tmp_path / "gpt2")
    code, _, err = cli("quantize", tmp_path / "gpt2", "-o", tmp_path / "out")
    _one_line_error(code, err, "Conv1D", "supported")


def test_group_size_does_not_divide(tmp_path, cli):
    src = make_tiny_model(tmp_path / "src", "llama")  # in_features 128 and 256
    code, _, err = cli("quantize", "--method", "rtn", src, "-o", tmp_path / "out", "--group-size", "512")
    _one_line_error(code, err, "model.layers.0.self_attn.q_proj", "in_features=128", "--group-size 32 or 64 or 128")
    assert not (tmp_path / "out").exists()


def test_output_not_empty(tmp_path, cli):
    """A non-empty folder quantkit did not write is never replaced, --overwrite or not (test_write_safety.py
    has the cases where --overwrite does replace: checkpoints quantkit wrote)."""
    src = make_tiny_model(tmp_path / "src", "llama")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("precious")
    for extra in ([], ["--overwrite"]):
        code, _, err = cli("quantize", "--method", "rtn", src, "-o", tmp_path / "out", "--group-size", "32", "--quiet", *extra)
        _one_line_error(code, err, "not empty", "not a quantkit checkpoint")
        assert (tmp_path / "out" / "keep.txt").read_text() == "precious"


def test_unknown_scheme(tmp_path, cli):
    src = make_tiny_model(tmp_path / "src", "llama")
    code, _, err = cli("quantize", "--method", "rtn", src, "-o", tmp_path / "out", "--scheme", "w4a61")
    assert code == 2 and "w4a61" in err and "w4a16" in err
    assert len(err.strip().splitlines()) == 1


def test_corrupt_safetensors(tmp_path, cli):
    src = make_tiny_model(tmp_path / "src", "llama")
    data = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(data[:8] + b"{not json" + data[20:200])
    code, _, err = cli("quantize", src, "-o", tmp_path / "out")
    _one_line_error(code, err, "corrupt", "model.safetensors" if "model.safetensors" in err else "safetensors")


def test_source_model_never_modified(tmp_path, cli):
    src = make_tiny_model(tmp_path / "src", "qwen2")
    before = tree_hash(src)
    assert cli("quantize", "--method", "rtn", src, "-o", tmp_path / "a", "--group-size", "64", "--set", "quant.symmetric=false", "--quiet")[0] == 0
    assert cli("quantize", "--method", "rtn", src, "-o", tmp_path / "b", "--scheme", "w8a16", "--quiet")[0] == 0
    assert tree_hash(src) == before


def test_killed_mid_write_leaves_no_output(tmp_path):
    """SIGKILL while the safetensors file is being written: OUT must not exist (only a hidden partial folder)."""
    src = make_tiny_model(tmp_path / "src", "llama")
    out = tmp_path / "out"
    script = textwrap.dedent(f"""
        import os, signal, sys
        import quantkit.formats.writer as w
        real = w.save_tensors
        def dying(folder, specs, tensors):
            real(folder, specs, tensors)      # the data is on disk in the temporary folder...
            os.kill(os.getpid(), signal.SIGKILL)   # ...and the process dies before the rename
        w.save_tensors = dying
        sys.argv = ["quantkit", "quantize", "--method", "rtn", {str(src)!r}, "-o", {str(out)!r}, "--quiet", "--group-size", "32"]
        from quantkit.cli import main
        main()
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL
    assert not out.exists()
    # the write's temporary folder holds the data; a streamed run's code spool (formats/code_spool.py) is a second
    # partial folder of the same claim, which the next run on OUT clears with it
    partial = [p for p in tmp_path.iterdir() if p.name.startswith(".out.partial-")]
    assert any((p / "model.safetensors").exists() for p in partial), partial
    p2 = subprocess.run([sys.executable, "-c", "from quantkit.cli import main; main()", "quantize", "--method", "rtn",
                         str(src), "-o", str(out), "--quiet", "--group-size", "32"], capture_output=True, text=True,
                        timeout=300)
    assert p2.returncode == 0, p2.stderr
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.partial-")]


def test_cli_json_and_progress(tmp_path, cli):
    src = make_tiny_model(tmp_path / "src", "llama")
    code, out, err = cli("quantize", "--method", "rtn", src, "-o", tmp_path / "a", "--group-size", "32", "--json")
    assert code == 0
    summary = json.loads(out)
    assert summary["layers"] == 14 and summary["group_size"] == 32 and summary["method"] == "rtn"
    code, out, err = cli("quantize", "--method", "rtn", src, "-o", tmp_path / "b", "--group-size", "32")
    assert code == 0 and "layer 2/2" in err  # the rich progress bar, per layer
    code, out, err = cli("quantize", "--method", "rtn", src, "-o", tmp_path / "c", "--group-size", "32", "--quiet")
    assert code == 0 and "layer" not in err and out == ""


@pytest.mark.parametrize("cmd", ["quantize", "inspect", "demo"])
def test_help_has_example(cli, cmd):
    code, out, _ = cli(cmd, "--help")
    assert code == 0 and "Example:" in out
