"""Each bad input raises UserError with a one-line message that names the problem and the fix."""
from __future__ import annotations

import json
import re

import pytest
import torch
from test_data_support import SAMPLE, tiny_tokenizer

from quantkit.data import load_calibration, load_eval_windows
from quantkit.data.specs import known_specs
from quantkit.errors import UserError


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def raises(msg_regex, *args, **kw):
    with pytest.raises(UserError) as e:
        load_calibration(*args, **kw)
    text = str(e.value)
    assert "\n" not in text
    assert re.search(msg_regex, text), text
    return text


@pytest.fixture
def empty_hub_cache(monkeypatch, tmp_path):
    """Point every Hugging Face cache at an empty folder, so nothing is cached whatever this machine holds."""
    import datasets.config
    from huggingface_hub import constants

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))


def test_named_dataset_offline_and_not_cached(tok, empty_hub_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    raises(r"dataset 'wikitext2' \(Salesforce/wikitext, wikitext-2-raw-v1, split train\) is not cached and the "
           r"hub is unreachable; pass a local file with --calib PATH$", "wikitext2", tok, num_samples=2, seq_len=16)
    with pytest.raises(UserError, match="not cached and the hub is unreachable; pass a local file with --data PATH"):
        load_eval_windows("c4", tok)


def test_named_dataset_with_unreachable_hub_fails_fast_without_offline_mode(tok, empty_hub_cache, monkeypatch):
    import datasets.config
    from huggingface_hub import constants

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    # Nothing listens on port 9 of this machine: the probe is refused at once instead of retrying for ~30 s.
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    raises("not cached and the hub is unreachable; pass a local file with --calib PATH", "ultrachat", tok)
    # The offline switch was only for the call.
    assert datasets.config.HF_HUB_OFFLINE is False and constants.HF_HUB_OFFLINE is False


def test_unknown_spec_lists_known_ones(tok):
    text = raises(r"unknown dataset spec 'wikitext3' \(did you mean 'wikitext2'\?\); known: self, ", "wikitext3", tok)
    for name in ["c4", "code", "gsm8k", "pile-val", "ultrachat", "wikitext2"]:
        assert name in text and name in known_specs()


def test_missing_path(tok, tmp_path):
    raises("no such file or folder; pass an existing file with --calib PATH", str(tmp_path / "nope.txt"), tok)


def test_missing_text_field_lists_fields(tok, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"title": "Cape", "body": "The lighthouse."}) + "\n")
    raises(r"has no field 'text'; fields present: title, body; pass --text-field NAME", str(f), tok)
    raises(r"has no field 'content'; fields present: title, body", str(f), tok, text_field="content")
    (tmp_path / "d.csv").write_text("title,body\nCape,The lighthouse.\n")
    raises(r"has no field 'text'; fields present: title, body", str(tmp_path / "d.csv"), tok)
    pq.write_table(pa.table({"title": ["Cape"], "body": ["The lighthouse."]}), tmp_path / "d.parquet")
    raises(r"has no field 'text'; fields present: title, body", str(tmp_path / "d.parquet"), tok)
    # A later line without the field is named by its line number.
    g = tmp_path / "g.jsonl"
    g.write_text(json.dumps({"text": "The keeper."}) + "\n\n" + json.dumps({"body": "x"}) + "\n")
    raises(r"g.jsonl line 3 has no field 'text'; fields present: body", str(g), tok)


def test_too_little_text_says_found_and_needed(tok):
    paras = [p.strip() for p in SAMPLE.read_text().split("\n\n") if p.strip()]
    found = len(tok("\n\n".join(paras), add_special_tokens=False)["input_ids"])
    need = 100 * 63  # 64-token samples less the BOS slot
    raises(rf"too little text in .*calib_sample.txt: found {found} tokens, need {need} .*lower --num-samples",
           str(SAMPLE), tok, num_samples=100, seq_len=64)
    raises(r"found \d+ tokens, need 1000 \(20 documents of at least 50 tokens; only [0-9] qualify\)",
           str(SAMPLE), tok, num_samples=20, seq_len=64, cut="document", min_tokens=50)


def test_empty_and_binary_files(tok, tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    raises(r"empty.txt is empty; pass a file that contains text", str(tmp_path / "empty.txt"), tok)
    (tmp_path / "blank.jsonl").write_text("\n \n\t\n")
    raises(r"blank.jsonl is empty", str(tmp_path / "blank.jsonl"), tok)
    g = torch.Generator().manual_seed(0)
    (tmp_path / "blob.txt").write_bytes(bytes(torch.randint(0, 256, (4096,), generator=g).tolist()))
    raises(r"blob.txt looks like a binary file, not UTF-8 text", str(tmp_path / "blob.txt"), tok)
    (tmp_path / "latin.txt").write_bytes("caf\xe9 cr\xe8me ".encode("latin-1") * 50)  # no NULs, not UTF-8
    raises(r"latin.txt looks like a binary file", str(tmp_path / "latin.txt"), tok)
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 this is not really parquet")
    raises(r"bad.parquet is not a readable parquet file", str(tmp_path / "bad.parquet"), tok)


def test_other_bad_inputs(tok, tmp_path):
    (tmp_path / "notes.docx").write_text("text")
    raises(r"unsupported file type '.docx'", str(tmp_path / "notes.docx"), tok)
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    raises(r"bad.jsonl line 2 is not valid JSON", str(tmp_path / "bad.jsonl"), tok)
    (tmp_path / "num.jsonl").write_text('{"text": 5}\n')
    raises(r"field 'text' holds int, not text", str(tmp_path / "num.jsonl"), tok)
    (tmp_path / "plain").mkdir()
    raises(r"not one written by datasets.save_to_disk", str(tmp_path / "plain"), tok)
    raises(r"unknown calibration cut 'lines'; choose one of: chunk, document", str(SAMPLE), tok, cut="lines")
    raises(r"--min-tokens must be between 1 and --seq-len \(16\)", str(SAMPLE), tok, cut="document",
           seq_len=16, min_tokens=40)
    raises(r"--seq-len must be at least 3", str(SAMPLE), tok, seq_len=2)
