"""Issue 37, requirement 6: a --seq-len beyond the model's context and calibration text that cannot give the
requested samples are refused before the model is loaded. "Before" is checked directly: reading a decoder
layer or loading the whole float model fails the test."""
from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer, GPT2Config, LlamaConfig

from damage import one_line_error
from quantkit.preflight import check_seq_len, context_length


@pytest.fixture(scope="module")
def src(tmp_path_factory, embedded_dir) -> Path:
    """A tiny llama (context 256) with SmolLM2's tokenizer."""
    from quantkit.testing.models import tiny_llama

    folder = tmp_path_factory.mktemp("src")
    tok = AutoTokenizer.from_pretrained(embedded_dir)
    tiny_llama(vocab_size=len(tok), max_positions=256).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture
def model_with_bad_weights(src, monkeypatch) -> Path:
    """SRC, with reading any decoder layer's weights, or loading the whole float model, failing the test (the
    lazy skeleton's embeddings, final norm and head are read when it is opened: a small part of any model)."""
    import quantkit.models.hf as hf
    from quantkit.models.lazy import LazyWeights

    materialise = LazyWeights.materialise

    def read_layers(self, keys):
        assert not any(k.startswith(f"{self.layers_name}.") for k in keys), "a layer was read before the refusal"
        return materialise(self, keys)

    def load_whole(*a, **k):
        raise AssertionError("the float model was loaded before the refusal")

    monkeypatch.setattr(LazyWeights, "materialise", read_layers)
    monkeypatch.setattr(hf, "load_float_model", load_whole)
    return src


@pytest.fixture(scope="module")
def prose(tmp_path_factory) -> Path:
    """About 1,500 tokens of prose: enough for 4 x 128 but not 64 x 128."""
    text = Path(__file__).parent.parent / "README.md"
    path = tmp_path_factory.mktemp("calib") / "prose.txt"
    path.write_text(text.read_text()[:6000])
    return path


def test_context_length_reads_each_architectures_key():
    assert context_length(LlamaConfig(max_position_embeddings=4096)) == (4096, "max_position_embeddings")
    assert context_length(GPT2Config(n_positions=1024)) == (1024, "n_positions")


def test_a_seq_len_within_the_context_passes_and_one_beyond_it_names_the_limit():
    cfg = LlamaConfig(max_position_embeddings=256)
    check_seq_len(256, cfg, "m")
    with pytest.raises(Exception) as e:
        check_seq_len(257, cfg, "m")
    assert "--seq-len 257" in str(e.value) and "256 tokens" in str(e.value) and "--seq-len 256 or less" in str(e.value)


@pytest.mark.parametrize("calib", ["self", "file"])
def test_seq_len_beyond_the_context_is_refused_before_loading(cli, tmp_path, model_with_bad_weights, prose, calib):
    spec = str(prose) if calib == "file" else "self"
    r = cli("quantize", model_with_bad_weights, "-o", tmp_path / "out", "--method", "gptq", "--calib", spec,
            "--seq-len", 1000, "--num-samples", 2)
    one_line_error(r, "--seq-len 1000", "256 tokens")
    assert not (tmp_path / "out").exists()


def test_too_little_calibration_text_is_refused_before_loading(cli, tmp_path, model_with_bad_weights, prose):
    r = cli("quantize", model_with_bad_weights, "-o", tmp_path / "out", "--method", "gptq", "--calib", prose,
            "--seq-len", 128, "--num-samples", 64)
    one_line_error(r, "too little text", "64 samples")
    assert not (tmp_path / "out").exists()


def test_without_calibration_the_seq_len_is_not_the_users_concern(cli, tmp_path, src):
    """RTN reads no text, so a --seq-len past the context cannot matter: the run is not refused."""
    r = cli("quantize", src, "-o", tmp_path / "out", "--method", "rtn", "--seq-len", 1000, "-q")
    assert r[0] == 0, r[2]
