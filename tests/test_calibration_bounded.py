"""Issue 37, requirement 4: a calibration file (or one line of it) far larger than the requested samples is
read in bounded time: the text handed to the tokenizer does not grow with the file, whatever the cut."""
from __future__ import annotations

import json
import random

import pytest
from transformers import AutoTokenizer

from quantkit.data import load_calibration
from quantkit.data.tokens import Encoder

NUM, SEQ = 4, 64


@pytest.fixture(scope="module")
def tok(embedded_dir):
    return AutoTokenizer.from_pretrained(embedded_dir)


@pytest.fixture(scope="module")
def huge_line(tmp_path_factory) -> str:
    """About 3 MB of prose on one line: 190x more text than 4 samples of 64 tokens need."""
    rng = random.Random(1)
    words = "the of a model weight scale token layer group text quantised cache every which runs".split()
    return " ".join(rng.choice(words) + rng.choice(["", "s", "ed", ","]) for _ in range(500_000))


@pytest.fixture
def tokenised_chars(monkeypatch):
    """The number of characters handed to the tokenizer during the test."""
    seen = [0]
    original = Encoder.encode

    def counting(self, texts):
        seen[0] += sum(len(t) for t in texts)
        return original(self, texts)

    monkeypatch.setattr(Encoder, "encode", counting)
    return seen


def _decoded(tok, cs) -> list[str]:
    return [tok.decode(s.tolist()) for s in cs.samples]


def test_a_huge_one_line_text_file_tokenises_a_bounded_part(tmp_path, tok, huge_line, tokenised_chars):
    path = tmp_path / "one_line.txt"
    path.write_text(huge_line)
    cs = load_calibration(str(path), tok, num_samples=NUM, seq_len=SEQ, seed=0)
    assert len(cs) == NUM and all(s.numel() == SEQ for s in cs.samples)
    assert tokenised_chars[0] <= NUM * (SEQ + 1) * 32 + 1000, tokenised_chars[0]  # not the file's 3 MB
    pieces = _decoded(tok, cs)
    assert all(p in huge_line for p in pieces)  # real spans of the text, tokenised as the model would
    starts = sorted(huge_line.index(p) for p in pieces)
    assert starts[-1] > len(huge_line) // 4  # picked across the text, not only from its start
    other = load_calibration(str(path), tok, num_samples=NUM, seq_len=SEQ, seed=1)
    assert _decoded(tok, other) != pieces  # the seed still chooses where


@pytest.mark.parametrize("cut", ["chunk", "document"])
def test_a_huge_jsonl_record_tokenises_a_bounded_part(tmp_path, tok, huge_line, tokenised_chars, cut):
    path = tmp_path / "records.jsonl"
    path.write_text("\n".join(json.dumps({"text": t}) for t in [huge_line] + ["a short note."] * 3) + "\n")
    cs = load_calibration(str(path), tok, num_samples=1, seq_len=SEQ, seed=0, cut=cut)
    assert cs.samples[0].numel() == SEQ
    assert tokenised_chars[0] <= 4 * SEQ * 32 + 1000, tokenised_chars[0]


def test_a_text_the_bound_allows_is_tokenised_whole_and_cut_as_before(tmp_path, tok, tokenised_chars):
    """Below the bound nothing changes: the chunks are slices of the whole text's tokens."""
    text = " ".join(f"line {i} of a small calibration file." for i in range(300))
    path = tmp_path / "small.txt"
    path.write_text(text)
    cs = load_calibration(str(path), tok, num_samples=NUM, seq_len=SEQ, seed=0)
    whole = tok(text, add_special_tokens=False)["input_ids"]
    for s in cs.samples:
        ids = s.tolist()
        assert any(whole[i:i + SEQ] == ids for i in range(0, len(whole) - SEQ + 1, SEQ))
    assert tokenised_chars[0] == len(text)
