"""`quantkit generate` and `quantkit serve` through typer, on a tiny random model saved with a real tokenizer."""
import json

import pytest
from transformers import AutoTokenizer
from typer.testing import CliRunner

import quantkit.cli.generate_cmd  # noqa: F401  (registers the command)
import quantkit.cli.serve_cmd  # noqa: F401
from quantkit.cli import app
from quantkit.errors import UserError
from quantkit.models.embedded import embedded_model_dir
from quantkit.testing.models import single_thread, tiny_llama


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    tok = AutoTokenizer.from_pretrained(embedded_model_dir())
    path = tmp_path_factory.mktemp("tiny")
    tiny_llama(vocab_size=len(tok), seed=9).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_generate_json_reports_completion_and_metrics(folder):
    with single_thread():
        r = CliRunner().invoke(app, ["generate", str(folder), "--prompt", "one two three one two three one",
                                     "--max-tokens", "9", "--prompt-lookup", "2", "--json"])
        plain = CliRunner().invoke(app, ["generate", str(folder), "--prompt", "one two three one two three one",
                                         "--max-tokens", "9", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    m = out["metrics"]
    assert m["output_tokens"] == 9 and len(out["tokens"]) == 9
    for key in ("acceptance_rate", "mean_accepted_length", "tokens_per_target_forward", "ttft_s", "tpot_s"):
        assert key in m
    # Greedy with prompt lookup gives the same completion as without.
    assert out["completion"] == json.loads(plain.stdout)["completion"]


def test_generate_refuses_bad_options(folder):
    r = CliRunner().invoke(app, ["generate", str(folder), "--prompt", "x", "--prompt-lookup", "2", "--draft", "self-w4"])
    assert isinstance(r.exception, UserError)
    r = CliRunner().invoke(app, ["generate", str(folder / "missing"), "--prompt", "x"])
    assert isinstance(r.exception, UserError)


def test_draft_with_another_vocabulary_is_refused(folder, tmp_path):
    tiny_llama(vocab_size=300).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(folder).save_pretrained(tmp_path)
    r = CliRunner().invoke(app, ["generate", str(folder), "--prompt", "x", "--draft", str(tmp_path)])
    assert isinstance(r.exception, UserError) and "vocabulary" in str(r.exception)


@pytest.mark.parametrize("cmd", ["generate", "serve"])
def test_help_has_an_example(cmd):
    r = CliRunner().invoke(app, [cmd, "--help"])
    assert r.exit_code == 0 and "Example: quantkit " + cmd in r.output


def test_generate_compile_gives_the_same_completion(folder, monkeypatch):
    from quantkit.runtime import build

    calls = []
    real = build.compile_decode
    monkeypatch.setattr(build, "compile_decode", lambda m: calls.append(m) or real(m))
    args = ["generate", str(folder), "--prompt", "one two three one two three one", "--max-tokens", "6", "--json"]
    with single_thread():
        compiled = CliRunner().invoke(app, args + ["--compile"])
        plain = CliRunner().invoke(app, args)
    assert compiled.exit_code == 0, compiled.output
    assert len(calls) == 1  # only the --compile run compiled, and it is the model that generated
    assert json.loads(compiled.stdout)["completion"] == json.loads(plain.stdout)["completion"]
