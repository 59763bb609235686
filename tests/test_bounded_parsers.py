"""Issue 37.4: recipes and calibration files past a bound are refused in one line naming the file and line,
in bounded time: YAML aliases that expand without end, nesting thousands deep, integers of thousands of
digits; JSONL the same; CSV fields longer than the csv module's default (128 KiB) are read up to a limit."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from quantkit.data import record_limits
from quantkit.data.local import load_local
from quantkit.errors import UserError


def _laughs(levels: int = 9, prefix: str = "") -> str:
    """The 'billion laughs': each level a list of nine aliases of the one before."""
    lines = [f'{prefix}l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"{prefix}l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def _validate(tmp_path, text: str):
    (tmp_path / "r.yaml").write_text(text)
    t = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", "from quantkit.cli import main; main()", "recipe", "validate",
                           str(tmp_path / "r.yaml")], capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert time.monotonic() - t < 60
    return lines[0]


def test_yaml_alias_bomb_is_refused(tmp_path):
    """A 501-byte recipe ran `quantkit recipe validate` until killed."""
    line = _validate(tmp_path, _laughs())
    assert "r.yaml:" in line and "expands to more than 100000 values" in line


def test_yaml_alias_bomb_under_a_valid_field_is_refused(tmp_path):
    text = "quant:\n  method: rtn\n" + _laughs(prefix="  ").replace("  l8:", "  ignore:")
    assert "expands to more than" in _validate(tmp_path, text)


def test_yaml_nested_5000_deep_is_refused(tmp_path):
    line = _validate(tmp_path, "quant:\n  ignore: " + "[" * 5000 + "]" * 5000 + "\n")
    assert "r.yaml:2: the recipe nests deeper than 100 levels" in line


def test_yaml_5000_digit_integer_is_refused(tmp_path):
    line = _validate(tmp_path, "calibration:\n  num_samples: " + "9" * 5000 + "\n")
    assert "r.yaml:2: the recipe holds an integer of 5000 digits" in line


def test_quoted_long_digits_are_a_string_not_a_number(tmp_path):
    line = _validate(tmp_path, f"model: '{'9' * 100}'\nquant:\n  group_size: x\n")
    assert "group_size" in line  # the quoted model name passed the bounds; the schema reports the real mistake


@pytest.mark.parametrize("line2, words", [
    ('{"text": ' + "[" * 5000 + "]" * 5000 + "}", ["line 2 nests too deeply"]),
    ('{"text": "x", "id": ' + "9" * 5000 + "}", ["line 2 holds an integer of 5000 digits"]),
    ("{not json", ["line 2 is not valid JSON"]),
])
def test_jsonl_bounds(tmp_path, line2, words):
    """5000-deep nesting or a 5000-digit integer in calibration JSONL: RecursionError / ValueError tracebacks."""
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "hello"}\n' + line2 + "\n")
    with pytest.raises(UserError) as e:
        load_local(path, "text")
    assert all(w in str(e.value) for w in words) and "\n" not in str(e.value)


def test_json_document_with_a_huge_integer(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('[{"text": "hi",\n "n": ' + "1" * 5000 + "}]")
    with pytest.raises(UserError, match="c.json holds an integer of 5000 digits"):
        load_local(path, "text")


def test_csv_field_longer_than_the_csv_default_is_read(tmp_path):
    """A CSV field over 131,072 characters was a _csv.Error traceback."""
    path = tmp_path / "c.csv"
    path.write_text('text\n"' + "word " * 40_000 + '"\nshort\n')
    corpus = load_local(path, "text")
    assert len(corpus.rows) == 2 and len(corpus.rows[0]) == 200_000


def test_csv_field_past_the_limit_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(record_limits, "MAX_CSV_FIELD", 1000)
    path = tmp_path / "c.csv"
    path.write_text('text\nshort\n"' + "x" * 2000 + '"\n')
    with pytest.raises(UserError, match=r"c.csv line 3: a field is longer than 1000 characters"):
        load_local(path, "text")
