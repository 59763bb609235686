"""Opening a damaged checkpoint (no tokenizer, truncated or padded weights, a missing shard) is one line and
exit code 2 from generate, serve and inspect, never a traceback or a wrong report (issue 20)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from damage import ckpt, damaged, one_line_error, run_cli  # noqa: F401  (fixtures)
from safetensors.torch import save_file

from quantkit.errors import UserError
from quantkit.formats.safetensors_header import read_header

FIX = "re-run quantkit quantize"
_one_line_error = one_line_error


def _args(cmd, folder):
    return [cmd, folder, "--prompt", "hi"] if cmd == "generate" else [cmd, folder]


@pytest.mark.parametrize("cmd", ["generate", "serve"])
def test_missing_tokenizer_names_the_files_and_where_to_copy_them_from(run_cli, damaged, cmd):
    for f in damaged.glob("tokenizer*"):
        f.unlink()
    source = json.loads((damaged / "quantkit.json").read_text())["source_model"]
    # the fix names the model the checkpoint was quantised from, as quantkit.json records it
    _one_line_error(run_cli(*_args(cmd, damaged)), "no tokenizer files", "tokenizer.json", f"from '{source}'")


def test_unloadable_tokenizer_is_one_line(run_cli, damaged):
    (damaged / "tokenizer.json").write_text('{"model": ')
    _one_line_error(run_cli(*_args("generate", damaged)), "tokenizer", "does not load", "tokenizer.json")


@pytest.mark.parametrize("cmd", ["generate", "serve", "inspect"])
def test_truncated_weights_are_refused(run_cli, damaged, cmd):
    weights = damaged / "model.safetensors"
    size = weights.stat().st_size
    os.truncate(weights, size - 1000)
    _one_line_error(run_cli(*_args(cmd, damaged)), "model.safetensors is truncated", str(size - 1000), FIX)


def test_bytes_after_the_last_tensor_are_refused(run_cli, damaged):
    with (damaged / "model.safetensors").open("ab") as fh:
        fh.write(b"\0" * 7)
    _one_line_error(run_cli("inspect", damaged), "7 bytes after its last tensor", FIX)


def test_missing_shard_is_named(run_cli, damaged):
    """A sharded copy that lost a shard: the index names a file that is not there."""
    (damaged / "model.safetensors").rename(damaged / "model-00001-of-00002.safetensors")
    keys = read_header(damaged / "model-00001-of-00002.safetensors")
    keys.pop("__metadata__", None)
    weight_map = {k: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, k in enumerate(sorted(keys))}
    (damaged / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    _one_line_error(run_cli(*_args("generate", damaged)), "model-00002-of-00002.safetensors is missing")


def test_read_header_refuses_every_truncation(tmp_path):
    """Cut anywhere (inside the length, the header or the data), a file is refused with a UserError."""
    path = tmp_path / "t.safetensors"
    save_file({"a": torch.arange(6, dtype=torch.int32).reshape(2, 3), "b": torch.ones(5)}, str(path))
    head = read_header(path)
    assert head["a"]["shape"] == [2, 3] and head["b"]["dtype"] == "F32"
    data = path.read_bytes()
    cut = tmp_path / "cut.safetensors"
    for n in range(len(data)):
        cut.write_bytes(data[:n])
        with pytest.raises(UserError):
            read_header(cut)


def test_serve_process_prints_one_line(damaged):
    """The whole process, as a user runs it: the issue's 54-line traceback is now one line and exit code 2."""
    for f in damaged.glob("tokenizer*"):
        f.unlink()
    r = subprocess.run([sys.executable, "-c", "from quantkit.cli import main; main()", "serve", str(damaged)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "no tokenizer files" in r.stderr
