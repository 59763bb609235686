"""Every calibration source on small files written here: .txt, .jsonl, .json, .csv, .parquet, a
save_to_disk folder and a named hub spec (with `datasets.load_dataset` replaced, since the hub is out of
reach in tests)."""
from __future__ import annotations

import json
import re

import pytest
import torch
from test_data_support import SAMPLE, tiny_tokenizer

import quantkit.data.hub as hub
from quantkit.data import load_calibration, load_eval_windows


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def paragraphs() -> list[str]:
    return [p.strip() for p in re.split(r"\n\s*\n", SAMPLE.read_text()) if p.strip()]


def plain_ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_txt_chunks_are_distinct_slices_of_the_whole_text(tok):
    ids = plain_ids(tok, "\n\n".join(paragraphs()))
    calib = load_calibration(str(SAMPLE), tok, num_samples=6, seq_len=48, seed=3)
    body = 47  # one slot goes to the BOS this tokenizer puts before every text
    starts = []
    for s in calib.samples:
        assert s.dtype == torch.long and s.shape == (48,)
        assert s[0].item() == tok.bos_token_id
        # The body must be one of the non-overlapping chunks of the full tokenisation.
        k = next(k for k in range(len(ids) // body) if ids[k * body:(k + 1) * body] == s[1:].tolist())
        starts.append(k)
    assert len(set(starts)) == 6 and starts == sorted(starts)
    assert calib.meta["source"]["kind"] == "file" and calib.meta["source"]["format"] == "txt"


def test_txt_documents_are_paragraphs(tok):
    paras = paragraphs()
    calib = load_calibration(str(SAMPLE), tok, num_samples=5, seq_len=40, seed=1, cut="document", min_tokens=20)
    assert len(calib.samples) == 5
    heads = set()
    for s in calib.samples:
        assert 20 <= len(s) <= 40 and s[0].item() == tok.bos_token_id
        # Each sample is the start of exactly one paragraph, truncated to seq_len.
        match = [p for p in paras if plain_ids(tok, p)[:len(s) - 1] == s[1:].tolist()]
        assert len(match) == 1
        heads.add(match[0])
    assert len(heads) == 5


def test_txt_without_blank_lines_is_one_document(tok, tmp_path):
    f = tmp_path / "one.txt"
    f.write_text(" ".join(paragraphs()[:3]))
    calib = load_calibration(str(f), tok, num_samples=1, seq_len=64, cut="document")
    assert calib.samples[0][1:].tolist() == plain_ids(tok, f.read_text().strip())[:63]


def test_txt_keeps_code_indentation(tok, tmp_path):
    code = "def f(x):\n    y = x + 1\n\n    return y * 2\n"
    f = tmp_path / "code.txt"
    f.write_text(code * 20)
    calib = load_calibration(str(f), tok, num_samples=2, seq_len=24, seed=0)
    text = tok.decode(torch.cat([s[1:] for s in calib.samples]))
    assert "\n\n    return y" in text


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_jsonl_text_field_and_custom_field(tok, tmp_path):
    paras = paragraphs()
    f = tmp_path / "d.jsonl"
    write_jsonl(f, [{"id": i, "body": p, "text": p} for i, p in enumerate(paras)])
    a = load_calibration(str(f), tok, num_samples=3, seq_len=32, cut="document", min_tokens=8)
    b = load_calibration(str(f), tok, num_samples=3, seq_len=32, cut="document", min_tokens=8, text_field="body")
    assert all(torch.equal(x, y) for x, y in zip(a.samples, b.samples))
    assert a.meta["source"]["format"] == "jsonl"


def test_jsonl_chat_goes_through_the_chat_template(tok, tmp_path):
    f = tmp_path / "chat.jsonl"
    chats = [[{"role": "user", "content": f"Tell me about the lighthouse, part {i}."},
              {"role": "assistant", "content": paragraphs()[i]}] for i in range(4)]
    write_jsonl(f, [{"messages": c} for c in chats])
    calib = load_calibration(str(f), tok, num_samples=4, seq_len=400, cut="document", min_tokens=8, seed=0)
    rendered = {tok.apply_chat_template(c, tokenize=False) for c in chats}
    for s in calib.samples:
        # The template supplies BOS/EOS itself; no second BOS is added in front.
        assert tok.decode(s) in rendered
        assert s[0].item() == tok.bos_token_id and s[1].item() != tok.bos_token_id
        assert (s == tok.eos_token_id).sum() == 2


def test_json_list_object_and_strings(tok, tmp_path):
    paras = paragraphs()
    forms = {"list.json": [{"text": p} for p in paras], "obj.json": {"data": [{"text": p} for p in paras]},
             "strings.json": paras}
    got = []
    for name, data in forms.items():
        (tmp_path / name).write_text(json.dumps(data))
        got.append(load_calibration(str(tmp_path / name), tok, num_samples=4, seq_len=32, seed=2).samples)
    assert all(torch.equal(x, y) for other in got[1:] for x, y in zip(got[0], other))


def test_csv_and_parquet_match_jsonl(tok, tmp_path):
    import csv

    import pyarrow as pa
    import pyarrow.parquet as pq

    paras = paragraphs()
    write_jsonl(tmp_path / "d.jsonl", [{"text": p, "n": i} for i, p in enumerate(paras)])
    with open(tmp_path / "d.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=["n", "text"])
        w.writeheader()
        w.writerows({"n": i, "text": p} for i, p in enumerate(paras))
    pq.write_table(pa.table({"n": list(range(len(paras))), "text": paras}), tmp_path / "d.parquet")
    sets = [load_calibration(str(tmp_path / f"d.{ext}"), tok, num_samples=5, seq_len=40, seed=7)
            for ext in ("jsonl", "csv", "parquet")]
    assert len({c.meta["sha256"] for c in sets}) == 1
    assert [c.meta["source"]["format"] for c in sets] == ["jsonl", "csv", "parquet"]


def test_save_to_disk_folder_picks_train_for_calibration_and_test_for_eval(tok, tmp_path):
    import datasets

    paras = paragraphs()
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": paras[:4]}),
                               "test": datasets.Dataset.from_dict({"text": paras[4:]})})
    dd.save_to_disk(str(tmp_path / "saved"))
    calib = load_calibration(str(tmp_path / "saved"), tok, num_samples=4, seq_len=24, cut="document", min_tokens=4)
    train_heads = {tuple(plain_ids(tok, p)[:23]) for p in paras[:4]}
    assert {tuple(s[1:].tolist()) for s in calib.samples} == train_heads
    assert calib.meta["source"]["kind"] == "saved_dataset" and calib.meta["source"]["split"] == "train"
    windows = load_eval_windows(str(tmp_path / "saved"), tok, seq_len=32)
    assert windows.meta["source"]["split"] == "test"
    test_ids = plain_ids(tok, paras[4])
    assert windows[0][1:].tolist() == test_ids[:31]


@pytest.fixture
def fake_hub(monkeypatch):
    """datasets.load_dataset answering from memory, recording how it was called."""
    import datasets

    calls = []
    tables = {}

    def load_dataset(path, name=None, split=None, data_files=None):
        calls.append({"path": path, "name": name, "split": split, "data_files": data_files})
        return datasets.Dataset.from_dict(tables[path])

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(hub, "hub_reachable", lambda timeout=hub.PROBE_TIMEOUT_S: True)
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    return calls, tables


def test_named_spec_wikitext2_is_continuous_and_uses_spec_splits(tok, fake_hub):
    calls, tables = fake_hub
    lines = []
    for p in paragraphs():
        lines += [" " + p + " \n", ""]
    tables["Salesforce/wikitext"] = {"text": lines}
    calib = load_calibration("wikitext2", tok, num_samples=4, seq_len=32, seed=0)
    windows = load_eval_windows("wikitext2", tok, seq_len=32, max_windows=3)
    assert calls == [{"path": "Salesforce/wikitext", "name": "wikitext-2-raw-v1", "split": "train", "data_files": None},
                     {"path": "Salesforce/wikitext", "name": "wikitext-2-raw-v1", "split": "test", "data_files": None}]
    ids = plain_ids(tok, "".join(lines))  # the spec joins rows with "" (they carry their own newlines)
    assert windows[1][1:].tolist() == ids[31:62] and len(windows) == 3
    assert all(any(ids[k:k + 31] == s[1:].tolist() for k in range(0, len(ids), 31)) for s in calib.samples)
    src = calib.meta["source"]
    assert (src["kind"], src["name"], src["config"], src["split"]) == ("hub", "Salesforce/wikitext",
                                                                      "wikitext-2-raw-v1", "train")
    assert "CC BY-SA" in src["license"]


def test_named_spec_c4_passes_data_files(tok, fake_hub):
    calls, tables = fake_hub
    tables["allenai/c4"] = {"text": paragraphs(), "url": ["u"] * len(paragraphs())}
    load_calibration("c4", tok, num_samples=2, seq_len=32)
    assert calls[0]["data_files"] == {"validation": "en/c4-validation.00000-of-00008.json.gz"}
    load_eval_windows("c4", tok, seq_len=32)
    assert calls[1]["data_files"] == {"validation": "en/c4-validation.00001-of-00008.json.gz"}


def test_named_spec_gsm8k_template_and_ultrachat_messages(tok, fake_hub):
    _, tables = fake_hub
    tables["openai/gsm8k"] = {"question": ["How many keepers lived on the cape?"] * 3,
                              "answer": ["One keeper and his family lived there. #### 1"] * 3}
    calib = load_calibration("gsm8k", tok, num_samples=1, seq_len=128, cut="document", min_tokens=4)
    assert tok.decode(calib.samples[0][1:]) == ("Question: How many keepers lived on the cape?\n"
                                                "Answer: One keeper and his family lived there. #### 1")
    chat = [{"role": "user", "content": "Who built the tower?"}, {"role": "assistant", "content": "The masons."}]
    tables["HuggingFaceH4/ultrachat_200k"] = {"prompt": ["Who built the tower?"], "messages": [chat]}
    calib = load_calibration("ultrachat", tok, num_samples=1, seq_len=128, cut="document", min_tokens=4)
    assert tok.decode(calib.samples[0]) == tok.apply_chat_template(chat, tokenize=False)
