"""A checkpoint's JSON files (config.json, quantkit.json, the shard index) read as one object, or one line.

A file may be empty, cut short, a list, nested beyond the parser's recursion limit, or a symlink to something
unreadable; each reader used to meet these as its own traceback.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import UserError


def read_json_object(path: Path, fix: str) -> dict:
    """PATH's JSON object; UserError naming PATH, what is wrong, and FIX (how to get a good copy)."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        cause = getattr(e, "strerror", None) or "not UTF-8 text"
        raise UserError(f"{path} cannot be read ({cause}); {fix}") from None
    if not text.strip():
        raise UserError(f"{path} is empty; {fix}")
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise UserError(f"{path} is not valid JSON ({e}); {fix}") from None
    except RecursionError:
        raise UserError(f"{path} is nested too deeply to be a checkpoint file; {fix}") from None
    if not isinstance(obj, dict):
        raise UserError(f"{path} holds a JSON {type(obj).__name__}, not an object; {fix}")
    return obj
