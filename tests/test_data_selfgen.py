"""Calibration text sampled from a tiny random llama: shape, reproducibility, distinct first tokens, and a
decode loop that matches transformers' own greedy generation when sampling is made greedy."""
from __future__ import annotations

import pytest
import torch
from test_data_support import tiny_llama, tiny_tokenizer

from quantkit.data import load_calibration
from quantkit.errors import UserError


@pytest.fixture(scope="module")
def model():
    return tiny_llama(len(tiny_tokenizer()))


def test_self_samples_shape_prefix_and_distinct_first_tokens(model):
    tok = tiny_tokenizer()
    calib = load_calibration("self", tok, num_samples=12, seq_len=24, seed=0, model=model, batch_size=5)
    assert len(calib.samples) == 12 and all(s.shape == (24,) for s in calib.samples)
    assert all(s[0].item() == tok.bos_token_id for s in calib.samples)
    firsts = [s[1].item() for s in calib.samples]
    assert len(set(firsts)) == 12 and not set(firsts) & set(tok.all_special_ids)
    assert calib.meta["source"]["kind"] == "self" and calib.meta["source"]["temperature"] == 0.8
    assert calib.meta["num_tokens"] == 12 * 24


def test_the_text_does_not_depend_on_how_many_rows_are_sampled_at_once(model):
    """The rows sampled at once are what the memory cap leaves (pipeline/sampling_copy.py); the text must not
    move with them."""
    tok = tiny_tokenizer()
    runs = [load_calibration("self", tok, num_samples=7, seq_len=16, seed=5, model=model, batch_size=b)
            for b in (7, 3, 1)]
    assert runs[0].meta["sha256"] == runs[1].meta["sha256"] == runs[2].meta["sha256"]


def test_self_is_reproducible_and_seed_dependent(model):
    tok = tiny_tokenizer()
    a = load_calibration("self", tok, num_samples=4, seq_len=16, seed=3, model=model)
    b = load_calibration("self", tok, num_samples=4, seq_len=16, seed=3, model=model)
    c = load_calibration("self", tok, num_samples=4, seq_len=16, seed=4, model=model)
    assert a.meta["sha256"] == b.meta["sha256"] and all(torch.equal(x, y) for x, y in zip(a.samples, b.samples))
    assert c.meta["sha256"] != a.meta["sha256"]


def test_near_zero_top_p_is_greedy_and_matches_model_generate(model):
    tok = tiny_tokenizer()
    # top_p so small that only the most likely token survives: sampling becomes argmax, so the cached
    # batched loop must reproduce transformers' greedy decoding token for token.
    calib = load_calibration("self", tok, num_samples=3, seq_len=20, seed=0, model=model, top_p=1e-9,
                             batch_size=3)
    for s in calib.samples:
        ref = model.generate(s[None, :2], max_new_tokens=18, do_sample=False, min_new_tokens=18,
                             pad_token_id=tok.pad_token_id)
        assert ref[0].tolist() == s.tolist()


def test_tokenizer_without_bos_conditions_on_start_token_but_does_not_keep_it(model):
    tok = tiny_tokenizer(add_bos=False)
    calib = load_calibration("self", tok, num_samples=4, seq_len=16, seed=0, model=model, top_p=1e-9)
    assert calib.meta["source"]["start_context_ids"] == [tok.bos_token_id]
    for s in calib.samples:
        assert s.shape == (16,) and s[0].item() not in tok.all_special_ids
        ctx = torch.tensor([[tok.bos_token_id, s[0].item()]])
        ref = model.generate(ctx, max_new_tokens=15, do_sample=False, min_new_tokens=15,
                             pad_token_id=tok.pad_token_id)
        assert ref[0, 1:].tolist() == s.tolist()


def test_self_needs_a_model():
    with pytest.raises(UserError, match="no model was given"):
        load_calibration("self", tiny_tokenizer(), num_samples=2, seq_len=8)


def test_a_vocabulary_of_special_tokens_only_still_samples(tmp_path):
    """Called directly with a tokenizer that has nothing but special tokens (transformers builds one for some
    model types from an empty folder), sampling draws from them instead of failing on an all-zero distribution."""
    from helpers import make_tiny_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = make_tiny_model(tmp_path / "gemma", "gemma")
    tok = AutoTokenizer.from_pretrained(folder)
    assert len(tok) == len(set(tok.all_special_ids))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    calib = load_calibration("self", tok, num_samples=3, seq_len=8, seed=0, model=model)
    assert [s.shape for s in calib.samples] == [(8,)] * 3
    assert all(int(s.max()) < len(tok) for s in calib.samples)
