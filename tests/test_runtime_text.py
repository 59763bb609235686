"""Incremental detokenisation and stop strings, with the embedded model's real tokenizer."""
import pytest
from transformers import AutoTokenizer

from quantkit.models.embedded import embedded_model_dir
from quantkit.runtime.text import Detokenizer


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(embedded_model_dir())


def test_streamed_pieces_join_to_the_full_text(tok):
    text = "Héllo wörld — naïve café, 日本語 text with emoji 🎉 and more words."
    d = Detokenizer(tok)
    pieces = [d.add(t) for t in tok(text, add_special_tokens=False)["input_ids"]]
    assert "".join(pieces) + d.flush() == text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_cuts_text_and_is_never_streamed(tok):
    text = "first line END second line"
    d = Detokenizer(tok, stop=["END"])
    pieces = []
    for t in tok(text, add_special_tokens=False)["input_ids"]:
        pieces.append(d.add(t))
        if d.stopped:
            break
    assert d.stopped and "".join(pieces) == "first line " and d.text == "first line "
