"""Evaluation data: perplexity windows (non-overlapping or strided) and JSONL task sets."""
from __future__ import annotations

import json
import re

import pytest
from test_data_support import SAMPLE, tiny_tokenizer

from quantkit.data import Task, load_eval_windows, load_tasks
from quantkit.errors import UserError


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def ids(tok):
    paras = [p.strip() for p in re.split(r"\n\s*\n", SAMPLE.read_text()) if p.strip()]
    return tok("\n\n".join(paras), add_special_tokens=False)["input_ids"]


def test_windows_tile_the_text_in_order(tok, ids):
    w = load_eval_windows(str(SAMPLE), tok, seq_len=100)
    body = 99
    assert len(w) == len(ids) // body == w.meta["num_windows"]
    for i, win in enumerate(w):
        assert win[0].item() == tok.bos_token_id and win[1:].tolist() == ids[i * body:(i + 1) * body]
    assert w.meta["stride"] == body and w.meta["text_tokens"] == len(ids)


def test_stride_and_max_windows(tok, ids):
    w = load_eval_windows(str(SAMPLE), tok, seq_len=65, stride=16)
    assert len(w) == (len(ids) - 64) // 16 + 1
    assert all(win[1:].tolist() == ids[16 * i:16 * i + 64] for i, win in enumerate(w))
    capped = load_eval_windows(str(SAMPLE), tok, seq_len=65, stride=16, max_windows=3)
    assert [c.tolist() for c in capped] == [c.tolist() for c in w[:3]]


def test_record_windows_keep_source_order_with_eos_between(tok, tmp_path):
    rows = ["The keeper rose before dawn.", "Ships passed often in those years.", "The lamp never went out."]
    f = tmp_path / "r.jsonl"
    f.write_text("\n".join(json.dumps({"text": r}) for r in rows))
    stream = []
    for r in rows:
        stream += tok(r, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    w = load_eval_windows(str(f), tok, seq_len=11)
    assert [x for win in w for x in win[1:].tolist()] == stream[:10 * len(w)]


def test_eval_bad_inputs(tok, tmp_path):
    with pytest.raises(UserError, match="'self' is for calibration only"):
        load_eval_windows("self", tok)
    with pytest.raises(UserError, match=r"found \d+ tokens, need 4095 for one window of 4096"):
        load_eval_windows(str(SAMPLE), tok, seq_len=4096)
    with pytest.raises(UserError, match=r"--stride must be between 1 and 63"):
        load_eval_windows(str(SAMPLE), tok, seq_len=64, stride=64)
    with pytest.raises(UserError, match="unknown dataset spec 'wikitxt2' .*known: c4, code"):
        load_eval_windows("wikitxt2", tok)


def test_load_tasks(tmp_path):
    f = tmp_path / "tasks.jsonl"
    lines = [{"id": "q1", "task": "arith", "prompt": "2+2=", "answer": 4},
             {"task": "arith", "prompt": "3+5="},
             {"id": "c1", "task": "recall", "prompt": "The lamp was", "answer": "lit", "choices": ["lit", "out"]}]
    f.write_text("\n".join(json.dumps(x) for x in lines[:2]) + "\n\n" + json.dumps(lines[2]) + "\n")
    tasks = load_tasks(f)
    assert tasks == [Task("q1", "arith", "2+2=", "4"), Task("line-2", "arith", "3+5=", None),
                     Task("c1", "recall", "The lamp was", "lit", {"choices": ["lit", "out"]})]


@pytest.mark.parametrize("content, msg", [
    ('{"id": 1, "prompt": "x"}', r"line 1 lacks text field\(s\) task; fields present: id, prompt"),
    ('{"id": 1, "task": "t", "prompt": "x"}\n{"id": 1, "task": "t", "prompt": "y"}', "id '1' already used on line 1"),
    ('{"task": "t", "prompt": "x"', "line 1 is not valid JSON"),
    ('["t", "x"]', "line 1 is not a JSON object"),
    ("\n\n", "is empty"),
])
def test_load_tasks_errors(tmp_path, content, msg):
    f = tmp_path / "t.jsonl"
    f.write_text(content)
    with pytest.raises(UserError, match=msg):
        load_tasks(f)


def test_load_tasks_missing_or_binary(tmp_path):
    with pytest.raises(UserError, match="no such task file"):
        load_tasks(tmp_path / "none.jsonl")
    (tmp_path / "b.jsonl").write_bytes(b"\x00\x01\x02")
    with pytest.raises(UserError, match="binary"):
        load_tasks(tmp_path / "b.jsonl")
