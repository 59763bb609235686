"""Cutting and reproducibility: chunking independent documents, byte-identical tensors for the same
spec/seed/tokenizer, and the metadata quantkit.json records."""
from __future__ import annotations

import hashlib
import json
import re

import pytest
import torch
from test_data_support import SAMPLE, tiny_tokenizer

from quantkit.data import CalibrationSet, load_calibration


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """The sample's paragraphs split into sentences: many short independent records."""
    text = SAMPLE.read_text()
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if s.strip()]
    path = tmp_path_factory.mktemp("rec") / "sentences.jsonl"
    path.write_text("\n".join(json.dumps({"text": s}) for s in sentences))
    return path, sentences


def test_same_inputs_give_byte_identical_tensors_and_hash(tok, records):
    path, _ = records
    a = load_calibration(str(path), tok, num_samples=5, seq_len=50, seed=11)
    b = load_calibration(str(path), tok, num_samples=5, seq_len=50, seed=11)
    assert [s.numpy().tobytes() for s in a.samples] == [s.numpy().tobytes() for s in b.samples]
    assert a.meta == b.meta
    c = load_calibration(str(path), tok, num_samples=5, seq_len=50, seed=12)
    assert c.meta["sha256"] != a.meta["sha256"]


def test_meta_records_what_was_used(tok, records):
    path, _ = records
    calib = load_calibration(str(path), tok, num_samples=4, seq_len=50, seed=5)
    m = calib.meta
    assert (m["spec"], m["cut"], m["seed"], m["seq_len"], m["num_samples"]) == (str(path), "chunk", 5, 50, 4)
    assert m["num_tokens"] == 200 == calib.num_tokens
    assert m["source"]["path"] == str(path.resolve())
    assert m["source"]["file_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    # The hash is over each sample's length then its int64 little-endian ids, recomputed here by hand.
    h = hashlib.sha256()
    for s in calib.samples:
        h.update(len(s).to_bytes(8, "little") + b"".join(int(t).to_bytes(8, "little", signed=True) for t in s))
    assert m["sha256"] == h.hexdigest()
    json.dumps(m)  # it goes into quantkit.json as is


def test_chunks_of_records_are_whole_documents_joined_by_eos(tok, records):
    path, sentences = records
    calib = load_calibration(str(path), tok, num_samples=4, seq_len=60, seed=0)
    assert all(s.shape == (60,) and s[0].item() == tok.bos_token_id for s in calib.samples)
    stream = torch.cat([s[1:] for s in calib.samples]).tolist()
    pieces = []
    cur = []
    for t in stream:
        if t == tok.eos_token_id:
            pieces.append(cur)
            cur = []
        else:
            cur.append(t)
    encoded = [tok(s, add_special_tokens=False)["input_ids"] for s in sentences]
    # Every complete piece is one whole sentence; the tail is the start of one; no sentence repeats.
    assert len(pieces) >= 3
    idx = [encoded.index(p) for p in pieces]
    assert len(set(idx)) == len(idx)
    assert any(e[:len(cur)] == cur for e in encoded)
    # The seed shuffles the records, so the first pieces are not simply the file's first sentences.
    assert idx[:3] != [0, 1, 2]


def test_document_cut_respects_min_tokens_and_truncates(tok, records):
    path, sentences = records
    calib = load_calibration(str(path), tok, num_samples=6, seq_len=20, seed=1, cut="document", min_tokens=15)
    lengths = {len(tok(s)["input_ids"]) for s in sentences}
    assert min(lengths) < 15 < 20 < max(lengths)  # the filter and the truncation both have work to do
    assert all(15 <= len(s) <= 20 for s in calib.samples)
    assert calib.meta["min_tokens"] == 15


def test_stacked_needs_equal_lengths(tok, records):
    path, _ = records
    calib = load_calibration(str(path), tok, num_samples=3, seq_len=40)
    assert calib.stacked().shape == (3, 40)
    ragged = CalibrationSet(samples=[torch.arange(3), torch.arange(4)])
    with pytest.raises(ValueError):
        ragged.stacked()
