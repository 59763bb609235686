"""Damaging a checkpoint on purpose: a real tiny W4 checkpoint, and edits of its tensors, safetensors header
and JSON files, for the integrity suites (tests/test_checkpoint_integrity.py, tests/test_checkpoint_fuzz.py)."""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

WEIGHTS = "model.safetensors"


def make_w4_checkpoint(tmp: Path) -> Path:
    """A W4 (group 64) checkpoint of a tiny random llama with SmolLM2's tokenizer, as `quantkit quantize`
    writes it, at TMP/w4."""
    from transformers import AutoTokenizer
    from typer.testing import CliRunner

    import quantkit.cli.quantize_cmd  # noqa: F401  (registers the command for CliRunner)
    from quantkit.cli import app
    from quantkit.models.embedded import embedded_model_dir
    from quantkit.testing.models import tiny_llama

    tok = AutoTokenizer.from_pretrained(embedded_model_dir())
    tiny_llama(vocab_size=len(tok), seed=3).save_pretrained(tmp / "src")
    tok.save_pretrained(tmp / "src")
    r = CliRunner().invoke(app, ["quantize", str(tmp / "src"), "-o", str(tmp / "w4"), "--quiet", "--method", "rtn",
                                 "--group-size", "64"])
    assert r.exit_code == 0, r.output
    return tmp / "w4"


def one_line_error(result, *words) -> str:
    """RESULT, a (code, stdout, stderr) of the in-process CLI, is exit 2 with one `error:` line holding WORDS."""
    code, out, err = result
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("error: ") and all(w in lines[0] for w in words), lines[0]
    assert out == ""  # nothing half-reported
    return lines[0]


def read_raw(folder: Path) -> tuple[dict, bytes]:
    """(header as JSON, data bytes) of FOLDER's weights file."""
    raw = (folder / WEIGHTS).read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_raw(folder: Path, head: dict, data: bytes) -> None:
    """Write HEAD and DATA back as FOLDER's weights file, the header padded with spaces as safetensors does."""
    text = json.dumps(head).encode()
    text += b" " * (-len(text) % 8)
    (folder / WEIGHTS).write_bytes(struct.pack("<Q", len(text)) + text + data)


def edit_tensors(folder: Path, edit) -> None:
    """Load every tensor, let EDIT change the dict in place, save them back."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / WEIGHTS))
    edit(tensors)
    save_file(tensors, str(folder / WEIGHTS), metadata={"format": "pt"})


def edit_json(folder: Path, name: str, edit) -> None:
    """EDIT(obj) changes FOLDER/NAME's JSON in place (or returns a replacement)."""
    obj = json.loads((folder / name).read_text())
    new = edit(obj)
    (folder / name).write_text(json.dumps(obj if new is None else new))


def edit_header_entry(folder: Path, name: str, edit) -> None:
    """EDIT(entry) changes the header entry of tensor NAME in place; the data bytes stay as they are."""
    head, data = read_raw(folder)
    edit(head[name])
    write_raw(folder, head, data)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """make_w4_checkpoint, once per test module."""
    folder = make_w4_checkpoint(tmp_path_factory.mktemp("ckpt"))
    assert (folder / "tokenizer.json").is_file()
    return folder


@pytest.fixture
def damaged(ckpt, tmp_path):
    """A copy of ckpt, for one test to damage."""
    copy = tmp_path / "copy"
    shutil.copytree(ckpt, copy)
    return copy


@pytest.fixture
def run_cli(cli, monkeypatch):
    """The in-process CLI, with serve unable to start a server: a load that wrongly succeeds fails the test."""
    import quantkit.cli.serve_cmd as serve_cmd

    def no_server(*a, **k):
        raise AssertionError("serve got past loading the checkpoint")

    monkeypatch.setattr(serve_cmd, "run", no_server)
    return cli
