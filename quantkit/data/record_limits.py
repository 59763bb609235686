"""Bounds on what one calibration or evaluation record may hold, so a hostile or broken file is one line
naming the file and line, never a parser's traceback: JSON nested past the parser's recursion limit, integers
with more digits than int() converts, and CSV fields beyond the csv module's default 128 KiB (a long document
is a fair CSV field, so the limit is raised to MAX_CSV_FIELD and anything past it is refused by line).
"""
from __future__ import annotations

import csv
import io
import json
from contextlib import contextmanager

from ..errors import UserError

MAX_DIGITS = 100  # an integer in a record is an id or a count, never a 100-digit number
MAX_CSV_FIELD = 64 * 1024**2


class NotJSON(UserError):
    """The text is not JSON at all (as opposed to JSON past a bound): a .json file may be JSON Lines."""


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_DIGITS:
        raise ValueError(f"an integer of {len(text.lstrip('-'))} digits (at most {MAX_DIGITS} are read)")
    return int(text)


def loads(text: str, where: str):
    """TEXT parsed as JSON; UserError naming WHERE (file and line) for invalid, too deep or too large input."""
    try:
        return json.loads(text, parse_int=_bounded_int)
    except json.JSONDecodeError as e:
        raise NotJSON(f"{where} is not valid JSON ({e.msg}); each line must be one JSON object") from None
    except RecursionError:
        raise UserError(f"{where} nests too deeply for a record (past the JSON parser's ~1000 levels); "
                        "flatten it") from None
    except ValueError as e:
        raise UserError(f"{where} holds {e}; remove it or store it as a string") from None


@contextmanager
def _field_limit(limit: int):
    old = csv.field_size_limit(limit)
    try:
        yield
    finally:
        csv.field_size_limit(old)


def csv_records(text: str, path) -> list[dict]:
    """The rows of CSV TEXT as dicts; UserError naming the line of a field over MAX_CSV_FIELD characters."""
    reader = csv.DictReader(io.StringIO(text))
    with _field_limit(MAX_CSV_FIELD):
        try:
            return list(reader)
        except csv.Error as e:
            # the line being parsed when it failed is not counted yet
            what = f"a field is longer than {MAX_CSV_FIELD} characters" if "field limit" in str(e) else str(e)
            raise UserError(f"{path} line {reader.line_num + 1}: {what}; split the document or pass JSONL") \
                from None
