"""Local sources: .txt, .jsonl, .json, .csv, .parquet files and folders written by datasets.save_to_disk."""
from __future__ import annotations

import hashlib
import re
from pathlib import Path

from ..errors import UserError
from .corpus import Corpus, LazyRows, RowReader
from .record_limits import NotJSON, csv_records, loads

SUFFIXES = (".txt", ".jsonl", ".json", ".csv", ".parquet")
_TEXT_SUFFIXES = {".txt", ".jsonl", ".json", ".csv"}


def _text_of(path: Path, data: bytes) -> str:
    # A NUL byte never occurs in UTF-8 prose but is common in binary files that happen to decode.
    if b"\x00" in data[:65536]:
        raise UserError(f"{path} looks like a binary file, not UTF-8 text; pass a text, JSONL, CSV or parquet file")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise UserError(f"{path} looks like a binary file, not UTF-8 text; pass a text, JSONL, CSV or parquet file") \
            from None
    if not text.strip():
        raise UserError(f"{path} is empty; pass a file that contains text")
    return text


def _records_corpus(path: Path, records: list, fmt: str, source: dict, text_field, line_of=None) -> Corpus:
    if not records:
        raise UserError(f"{path} is empty; pass a file that contains text")
    first = records[0]
    if isinstance(first, str):  # a JSON list of strings (or JSONL of strings) is plain documents
        bad = next((i for i, r in enumerate(records) if not isinstance(r, str)), None)
        if bad is not None:
            raise UserError(f"{path}: record {bad + 1} is not a string like the first one")
        return Corpus(rows=records, source=source)
    if not isinstance(first, dict):
        raise UserError(f"{path}: records must be JSON objects with a text field, got {type(first).__name__}")
    reader = RowReader(list(first), str(path), text_field=text_field)
    where = (lambda i: f"{path} line {line_of[i]}") if line_of else (lambda i: f"{path} record {i + 1}")
    rows = []
    for i, r in enumerate(records):
        if not isinstance(r, dict):
            raise UserError(f"{where(i)} is not a JSON object")
        rows.append(reader(r, where(i)))
    return Corpus(rows=rows, source=source)


def _jsonl(path: Path, text: str, source: dict, text_field) -> Corpus:
    records, lines = [], []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        records.append(loads(line, f"{path} line {n}"))
        lines.append(n)
    return _records_corpus(path, records, "jsonl", source, text_field, line_of=lines)


def _json(path: Path, text: str, source: dict, text_field) -> Corpus:
    try:
        data = loads(text, str(path))
    except NotJSON:
        return _jsonl(path, text, source, text_field)  # JSON Lines saved under .json
    if isinstance(data, dict):
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) != 1:
            raise UserError(f"{path}: expected a JSON list of records (or an object holding one list), "
                            f"found an object with keys {', '.join(data)}")
        data = lists[0]
    if not isinstance(data, list):
        raise UserError(f"{path}: expected a JSON list of records, found {type(data).__name__}")
    return _records_corpus(path, data, "json", source, text_field)


def _csv(path: Path, text: str, source: dict, text_field) -> Corpus:
    records = csv_records(text, path)
    if not records:
        raise UserError(f"{path} is empty; pass a file that contains text")
    return _records_corpus(path, records, "csv", source, text_field)


def _parquet(path: Path, source: dict, text_field) -> Corpus:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for a corrupt or non-parquet file
        raise UserError(f"{path} is not a readable parquet file ({type(e).__name__}); pass a valid .parquet file") \
            from None
    if table.num_rows == 0:
        raise UserError(f"{path} is empty; pass a file that contains text")
    return _records_corpus(path, table.to_pylist(), "parquet", source, text_field)


def _txt(path: Path, text: str, source: dict) -> Corpus:
    # Blank lines separate documents; a file without blank lines is one document. Either way the blocks
    # are consecutive parts of one text, so the corpus is continuous.
    # Leading spaces are kept: in code they are indentation.
    blocks = [b.lstrip("\r\n").rstrip() for b in re.split(r"\n[ \t]*\n", text)]
    return Corpus(rows=[b for b in blocks if b.strip()], source=source, continuous=True, separator="\n\n")


def _saved_dataset(path: Path, for_eval: bool, text_field) -> Corpus:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:
        raise UserError(f"{path} is a folder but not one written by datasets.save_to_disk ({type(e).__name__}); "
                        f"pass a file or a saved dataset folder") from None
    split = None
    if isinstance(ds, datasets.DatasetDict):
        prefer = ("test", "validation", "train") if for_eval else ("train", "validation", "test")
        split = next((s for s in prefer if s in ds), next(iter(ds)))
        ds = ds[split]
    if len(ds) == 0:
        raise UserError(f"{path} holds an empty dataset; pass one with text")
    reader = RowReader(ds.column_names, str(path), text_field=text_field)
    source = {"kind": "saved_dataset", "path": str(path), "split": split, "fingerprint": ds._fingerprint,
              "rows": len(ds)}
    ds = ds if reader.template else ds.select_columns([reader.field])
    return Corpus(rows=LazyRows(len(ds), lambda i: reader(ds[i], f"{path} row {i}")), source=source)


def load_local(path: Path, text_field: str | None, for_eval: bool = False) -> Corpus:
    path = path.resolve()
    if path.is_dir():
        return _saved_dataset(path, for_eval, text_field)
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise UserError(f"{path}: unsupported file type '{suffix}'; use one of {', '.join(SUFFIXES)} "
                        f"or a datasets.save_to_disk folder")
    data = path.read_bytes()
    if not data:
        raise UserError(f"{path} is empty; pass a file that contains text")
    source = {"kind": "file", "path": str(path), "format": suffix[1:], "file_sha256": hashlib.sha256(data).hexdigest()}
    if suffix == ".parquet":
        return _parquet(path, source, text_field)
    text = _text_of(path, data)
    if suffix == ".txt":
        return _txt(path, text, source)
    return {".jsonl": _jsonl, ".json": _json, ".csv": _csv}[suffix](path, text, source, text_field)
